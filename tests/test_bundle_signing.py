"""Signed bundles through a real execute service: every way a store writer can tamper with a bundle is refused on
LoadModel naming the key and the signer (FAILED_PRECONDITION for a signature that does not verify, DATA_LOSS for a
file that differs from its signed sha256), its payload never runs, and the server goes on serving. The bundle is
the session's compiled tiny model, copied into a store of the test's own."""

import json
import pickle
import shutil
import subprocess
import sys

import grpc
import pytest
from conftest import TINY_CONFIG, TINY_MODEL, BackgroundServer, load_model
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store import bundle
from kiln.store.signing import Signer, TrustedKeys, key_id
from protos import common_pb2, exec_pb2, exec_pb2_grpc


class WritesMarker:
    """A pickle payload: unpickling it runs ``open(marker, 'w')``, as a crafted bundle's would run anything."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the payload ran')",)


def malicious_pickle(marker) -> bytes:
    return pickle.dumps(WritesMarker(marker))


def test_the_payload_is_live(tmp_path):
    """The tampering below is real: unpickling this payload in a fresh process writes its marker."""
    proof = tmp_path / "proof"
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=malicious_pickle(proof), check=True, timeout=60)
    assert proof.read_text() == "the payload ran"


@pytest.fixture(scope="module")
def tamper_store(tmp_path_factory):
    return tmp_path_factory.mktemp("tamper-store")


@pytest.fixture(scope="module")
def shared_exec(tamper_store, trusted_keys, tiny_key):
    """An execute service reading ``tamper_store`` in place (a shared store), trusting the session's signer only."""
    from exec_service.server import ExecServerSettings, start_exec_server

    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, store=tamper_store)
    server = BackgroundServer(lambda: start_exec_server(settings))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    yield exec_pb2_grpc.ExecServiceStub(channel), channel
    channel.close()
    server.stop()


def rewrite_manifest(path, key: str) -> None:
    """What a store writer can do: recompute the manifest over whatever files are there now."""
    manifest = bundle.read_manifest(path)
    fields = {k: v for k, v in manifest.__dict__.items() if k not in ("files", "key")}
    bundle.write_manifest(path, key=key, **fields)


def file_changed(path, marker, key):
    data = bytearray((path / bundle.compiled_layer_file(0)).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / bundle.compiled_layer_file(0)).write_bytes(bytes(data))


def pickle_swapped_manifest_recomputed(path, marker, key):
    (path / bundle.compiled_layer_file(0)).write_bytes(malicious_pickle(marker))
    rewrite_manifest(path, key)


def signed_by_another_key(path, marker, key):
    (path / bundle.compiled_layer_file(0)).write_bytes(malicious_pickle(marker))
    rewrite_manifest(path, key)
    bundle.sign(path, Signer(Ed25519PrivateKey.generate()))


def signature_stripped(path, marker, key):
    (path / bundle.compiled_layer_file(0)).write_bytes(malicious_pickle(marker))
    rewrite_manifest(path, key)
    (path / bundle.SIGNATURE).unlink()


def signature_garbled(path, marker, key):
    (path / bundle.SIGNATURE).write_text("{not json")


@pytest.mark.parametrize("tamper, code, reason", [
    (file_changed, grpc.StatusCode.DATA_LOSS, "compiled_layer0.bin differs from the sha256 its manifest lists"),
    (pickle_swapped_manifest_recomputed, grpc.StatusCode.FAILED_PRECONDITION, "does not match the manifest"),
    (signed_by_another_key, grpc.StatusCode.FAILED_PRECONDITION, "is not a trusted key here"),
    (signature_stripped, grpc.StatusCode.FAILED_PRECONDITION, "unsigned (no manifest.sig)"),
    (signature_garbled, grpc.StatusCode.FAILED_PRECONDITION, "malformed signature file"),
])
def test_tampered_bundle_is_refused_and_its_payload_never_runs(shared_exec, tamper_store, compile_store, tiny_key,
                                                                signer, tmp_path, tamper, code, reason):
    stub, channel = shared_exec
    target = tamper_store / tiny_key
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(compile_store / tiny_key, target)
    marker = tmp_path / "marker"
    tamper(target, marker, tiny_key)
    name = f"tampered-{tamper.__name__}".replace("_", "-")

    with pytest.raises(grpc.RpcError) as exc:
        load_model(stub, name, key=common_pb2.ArtifactKey(digest=tiny_key))
    assert exc.value.code() == code, exc.value.details()
    details = exc.value.details()
    assert f"bundle {tiny_key}" in details and reason in details, details
    if tamper is signed_by_another_key:
        assert "signer: ed25519:" in details and signer.key_id not in details.split("(trusted:")[0]
    elif tamper in (file_changed, pickle_swapped_manifest_recomputed):
        assert f"signer: {signer.key_id}" in details
    assert not marker.exists(), "the crafted pickle ran"
    info = next(m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models if m.name == name)
    assert info.state == exec_pb2.MODEL_STATE_FAILED and "refused" in info.error

    # The server goes on serving: the genuine bundle loads and generates.
    shutil.rmtree(target)
    shutil.copytree(compile_store / tiny_key, target)
    good = f"good-after-{tamper.__name__}".replace("_", "-")
    load_model(stub, good, key=common_pb2.ArtifactKey(digest=tiny_key))
    out = list(stub.Generate(exec_pb2.GenerateRequest(model=good, prompt_ids=[1, 2, 3], max_tokens=2,
                                                      ignore_eos=True)))  # sampled: an end token could come first
    assert sum(len(r.token_ids) for r in out) == 2
    stub.UnloadModel(exec_pb2.UnloadModelRequest(name=good))
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_signed_bundle_under_another_key_is_refused(shared_exec, tamper_store, compile_store, tiny_key):
    """A genuine, signed bundle copied to another key's place: the signed manifest names its own key."""
    stub, _ = shared_exec
    other = "e" * 64
    shutil.copytree(compile_store / tiny_key, tamper_store / other, dirs_exist_ok=True)
    with pytest.raises(grpc.RpcError) as exc:
        load_model(stub, "replayed", key=common_pb2.ArtifactKey(digest=other))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"signed manifest is for another key, {tiny_key}" in exc.value.details()


def test_rotation_trusts_several_keys_at_once(tmp_path, compile_store, tiny_key, signer):
    """A directory of public keys: a bundle signed by the old key or the new one verifies; by neither, it does not."""
    new = Signer(Ed25519PrivateKey.generate())
    keys = tmp_path / "trusted"
    keys.mkdir()
    (keys / "old.pub").write_bytes(_pem(signer))
    (keys / "new.pub").write_bytes(_pem(new))
    trusted = TrustedKeys.load(keys)
    assert set(trusted.keys) == {signer.key_id, new.key_id}

    copy = tmp_path / tiny_key
    shutil.copytree(compile_store / tiny_key, copy)
    assert bundle.verify_signed(copy, tiny_key, trusted).key == tiny_key  # signed by the old key
    bundle.sign(copy, new)
    assert bundle.verify_signed(copy, tiny_key, trusted).key == tiny_key  # re-signed by the new one
    assert json.loads((copy / bundle.SIGNATURE).read_text())["signer"] == key_id(new.public_key)
    (keys / "old.pub").unlink()
    bundle.sign(copy, signer)
    with pytest.raises(bundle.UntrustedBundle, match="not a trusted key"):
        bundle.verify_signed(copy, tiny_key, TrustedKeys.load(keys))


def test_the_compile_service_recompiles_over_an_unsigned_bundle(compile_stub, compile_store, tiny_key):
    """The compile service's own store reads: a bundle whose signature does not verify is not a hit."""
    from conftest import compile_result

    (compile_store / tiny_key / bundle.SIGNATURE).unlink()
    result = compile_result(compile_stub, TINY_MODEL, TINY_CONFIG)
    assert not result.cache_hit and result.key.digest == tiny_key
    assert (compile_store / tiny_key / bundle.SIGNATURE).is_file()
    assert compile_result(compile_stub, TINY_MODEL, TINY_CONFIG).cache_hit


def _pem(signer: Signer) -> bytes:
    from kiln.store.signing import public_pem

    return public_pem(signer.public_key)
