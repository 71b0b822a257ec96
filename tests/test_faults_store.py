"""The store is untrusted until the signature says otherwise, and no wait on it is unbounded: planted entries in a
real redis-server and planted files in a real store directory, read by the real stores and the real compile
service."""

import hashlib
import json
import os
import signal
import threading
import time
import tracemalloc
from pathlib import Path

import grpc
import pytest
from conftest import BackgroundServer
from redis_server import RedisServer

from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store import bundle
from kiln.store.artifact_store import FilesystemStore
from kiln.store.bundle import CorruptBundle, UntrustedBundle
from kiln.store.redis_store import RedisStore, StoreUnavailable
from kiln.store.signing import Signer, TrustedKeys, generate_key_pair
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

CHUNK = 4096


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def keys(tmp_path) -> tuple[Signer, TrustedKeys]:
    private, public = generate_key_pair(tmp_path / "keys")
    return Signer.load(private), TrustedKeys.load(public)


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def stage(store, key: str, payload: bytes) -> Path:
    staged = store.staging_dir()
    (staged / bundle.compiled_layer_file(0)).write_bytes(payload)
    (staged / bundle.KEY_FACTORS).write_text(json.dumps({"for": key}))
    bundle.write_manifest(staged, key=key, model="tiny", config_summary="test", num_pieces=1, num_splits=0,
                          timings={}, created_unix=time.time())
    return staged


def commit(store, key: str, payload: bytes) -> Path:
    with store.lock(key):
        return store.commit(key, stage(store, key, payload))


def getranges(server: RedisServer) -> int:
    """How many chunk reads the server has answered: Redis's own command counter."""
    return server.client().info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)


def test_a_planted_chunk_count_or_chunk_list_allocates_nothing(redis_server, tmp_path, keys):
    """The entry's chunk list (30 MB of JSON) and a manifest claiming 10^12 bytes in 10^9 chunks: read in bounded
    fields, refused by the reader, removed by the writer; the memory of the read stays under a megabyte."""
    signer, trusted = keys
    store = RedisStore(redis_server.url(), tmp_path / "compile", chunk_bytes=CHUNK, signer=signer, trusted=trusted)
    key = key_of("planted")
    commit(store, key, os.urandom(3 * CHUNK))
    client = redis_server.client()
    client.hset(f"kiln:bundle:{key}", "chunks", json.dumps({f"f{i}": 10**9 for i in range(1_500_000)}))
    replica = RedisStore(redis_server.url(), tmp_path / "replica", read_only=True, trusted=trusted)
    store.cache.delete(key)
    tracemalloc.start()
    assert replica.get(key) is not None, "a chunk list that is never read changes nothing"
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to read a 12 KB bundle"

    other = key_of("claims a terabyte")
    manifest = bundle.Manifest(key=other, model="m", config_summary="s", num_pieces=1, num_splits=0, timings={},
                               created_unix=0.0, files={bundle.compiled_layer_file(0): {"sha256": "0" * 64,
                                                                                         "size": 10**12}})
    client.hset(f"kiln:bundle:{other}", mapping={"manifest": manifest.to_json(), "generation": "a" * 32,
                                                 "chunk_bytes": 1024 * 1024})
    unsigned = RedisStore(redis_server.url(), tmp_path / "unsigned", read_only=True)
    with pytest.raises(CorruptBundle, match=r"1000000000000 bytes, more than the \d+ this store reads") as refused:
        unsigned.get(other)
    assert refused.value.code == "DATA_LOSS"
    with store.lock(other):
        assert store.get(other) is None, "the writer removes it, so that it is compiled again"
    assert not client.exists(f"kiln:bundle:{other}")


def test_an_unsigned_bundle_never_reaches_a_replicas_disk(redis_server, tmp_path, keys):
    """A forged bundle (no signature, or another key's): refused before a single chunk is read, nothing staged."""
    _, trusted = keys
    forger = RedisStore(redis_server.url(), tmp_path / "forger", chunk_bytes=CHUNK,
                        signer=Signer.load(generate_key_pair(tmp_path / "other")[0]))
    unsigned = RedisStore(redis_server.url(), tmp_path / "unsigned-writer", chunk_bytes=CHUNK)
    forged, plain = key_of("forged"), key_of("plain")
    commit(forger, forged, os.urandom(64 * CHUNK))
    commit(unsigned, plain, os.urandom(64 * CHUNK))
    replica = RedisStore(redis_server.url(), tmp_path / "replica", read_only=True, trusted=trusted)
    before = getranges(redis_server)
    for key, signer in ((forged, "ed25519:"), (plain, "none")):
        with pytest.raises(UntrustedBundle, match=f"signer: {signer}") as refused:
            replica.get(key)
        assert refused.value.code == "FAILED_PRECONDITION"
    assert getranges(redis_server) == before, "chunks of an untrusted bundle were read"
    assert not list((tmp_path / "replica").glob("*/*")), "bytes of an untrusted bundle reached the disk"


def test_one_bad_entry_is_that_keys_data_loss_and_list_artifacts_skips_it(redis_server, tmp_path, signer):
    """Through the compile service on Redis: an oversized manifest, a string where a hash belongs and a name that is
    no key sit beside a good bundle; ListArtifacts lists the good one, names the others, and removes the bad keys."""
    from compile_service.server import CompileServerSettings, start_compile_server

    server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", redis_server.url(), signer, cache_dir=tmp_path / "cache")))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    try:
        store = RedisStore(redis_server.url(), tmp_path / "writer", chunk_bytes=CHUNK, signer=signer)
        good, huge, wrong_type = key_of("good"), key_of("huge"), key_of("wrong type")
        commit(store, good, b"fine")
        client = redis_server.client()
        client.hset(f"kiln:bundle:{huge}", mapping={"manifest": b"{" * (2 << 20), "generation": "b" * 32})
        client.set(f"kiln:bundle:{wrong_type}", b"not a hash")
        client.zadd("kiln:index", {huge: 1.0, wrong_type: 2.0, "../../etc": 3.0})
        stub = compile_pb2_grpc.CompileServiceStub(channel)
        listed = stub.ListArtifacts(compile_pb2.ListArtifactsRequest(), timeout=30)
        assert [a.key.digest for a in listed.artifacts] == [good]
        reasons = {u.name: u.reason for u in listed.unreadable}
        assert set(reasons) == {huge, wrong_type, "../../etc"}
        assert "more than 1048576 bytes" in reasons[huge] and "not a hash" in reasons[wrong_type]
        assert not client.exists(f"kiln:bundle:{huge}") and not client.exists(f"kiln:bundle:{wrong_type}")
        with pytest.raises(grpc.RpcError) as gone:
            stub.GetArtifact(compile_pb2.GetArtifactRequest(key=common_pb2.ArtifactKey(digest=huge)),
                             timeout=30).next()
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()
        server.stop()


def test_a_frozen_redis_is_unavailable_naming_it_within_the_timeout(redis_server, tmp_path):
    """SIGSTOP: the connection stays open and nothing answers. Every call ends within the store's timeout."""
    store = RedisStore(redis_server.url(), tmp_path / "writer", chunk_bytes=CHUNK)
    key = key_of("frozen")
    commit(store, key, b"kept")
    replica = RedisStore(redis_server.url(), tmp_path / "replica", read_only=True, timeout_s=1.0)
    replica.list()  # connected
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        for call in (lambda: replica.get(key), replica.list):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=rf"store {redis_server.url()} did not answer within 1 s"):
                call()
            assert time.monotonic() - started < 3
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)


def test_a_lease_without_an_expiry_is_stale_and_taken_over(redis_server, tmp_path):
    store = RedisStore(redis_server.url(), tmp_path / "writer", chunk_bytes=CHUNK, lease_s=1.0)
    key, longer = key_of("lease forever"), key_of("lease for a day")
    client = redis_server.client()
    client.set(f"kiln:lease:{key}", "someone")
    client.set(f"kiln:lease:{longer}", "someone", ex=86400)
    for planted in (key, longer):
        acquired = threading.Event()

        def take(planted=planted, acquired=acquired):
            with store.lock(planted):
                acquired.set()

        threading.Thread(target=take, daemon=True).start()
        assert acquired.wait(5), "a lease that never expires blocked its key"


def test_a_fifo_or_a_link_in_a_store_is_data_loss_not_a_hang(tmp_path, compile_server, compile_store, signer):
    """A signed bundle whose compiled layer is swapped for a FIFO (a read would block forever) or a link out of the
    store: GetArtifact answers DATA_LOSS at once, and the bundle is quarantined."""
    stub = compile_pb2_grpc.CompileServiceStub(grpc.insecure_channel(compile_server.address, options=CHANNEL_OPTIONS))
    store = FilesystemStore(compile_store, signer)
    outside = tmp_path / "secret"
    outside.write_bytes(b"outside the store")
    for name, plant in (("fifo", os.mkfifo), ("link", lambda p: os.symlink(outside, p))):
        key = key_of(name)
        commit(store, key, b"code")
        victim = compile_store / key / bundle.compiled_layer_file(0)
        victim.unlink()
        plant(victim)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GetArtifact(compile_pb2.GetArtifactRequest(key=common_pb2.ArtifactKey(digest=key)), timeout=10))
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS, refused.value.details()
        assert not (compile_store / key).exists() and (compile_store / ".quarantine" / key).exists()


def test_a_bundle_directory_swapped_for_a_link_is_data_loss(tmp_path, compile_server, compile_store, signer):
    stub = compile_pb2_grpc.CompileServiceStub(grpc.insecure_channel(compile_server.address, options=CHANNEL_OPTIONS))
    store = FilesystemStore(compile_store, signer)
    real, swapped = key_of("real"), key_of("swapped")
    commit(store, real, b"code")
    os.symlink(compile_store / real, compile_store / swapped)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.GetArtifact(compile_pb2.GetArtifactRequest(key=common_pb2.ArtifactKey(digest=swapped)), timeout=10))
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert "not a directory" in refused.value.details()
    listed = stub.ListArtifacts(compile_pb2.ListArtifactsRequest(), timeout=10)
    assert swapped not in {a.key.digest for a in listed.artifacts}


def compile_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "compile_model" and t.is_alive()]


@pytest.mark.parametrize("backend", ["redis", "directory"])
def test_a_compile_waiting_on_a_held_lock_gives_up_at_the_calls_deadline(backend, tmp_path, signer):
    """Another holder keeps the key's lock (a live lease, or the lock file's flock): the Compile ends at its
    deadline, and so does the worker thread that waited for it, rather than waiting on for a client that is gone."""
    from compile_service.server import CompileServerSettings, start_compile_server

    redis = RedisServer(tmp_path / "redis").start() if backend == "redis" else None
    store = redis.url() if redis else tmp_path / "store"
    server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", store, signer, cache_dir=tmp_path / "cache")))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    release = threading.Event()
    try:
        stub = compile_pb2_grpc.CompileServiceStub(channel)
        request = compile_pb2.CompileRequest(model=common_pb2.ModelSpec(preset="tiny-llama"),
                                             config=common_pb2.CompileConfig(device="cpu"))
        (looked_up,) = stub.Compile(compile_pb2.CompileRequest(model=request.model, config=request.config,
                                                               key_only=True), timeout=60)
        key = looked_up.result.key.digest
        if redis:
            redis.client().set(f"kiln:lease:{key}", "another compile service", px=120_000)
        else:
            held = threading.Event()

            def hold():
                with FilesystemStore(store).lock(key):
                    held.set()
                    release.wait(60)

            threading.Thread(target=hold, daemon=True).start()
            assert held.wait(10)
        with pytest.raises(grpc.RpcError) as waited:
            list(stub.Compile(request, timeout=2))
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while compile_threads() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not compile_threads(), "the worker thread still waits for the lock"
    finally:
        release.set()
        channel.close()
        server.stop()
        if redis:
            redis.stop()


def test_a_replicas_load_model_refuses_planted_and_forged_entries_before_reading_a_chunk(redis_server, tmp_path,
                                                                                          signer, trusted_keys):
    """Through an execute replica on the shared Redis, LoadModel by key: an unsigned entry claiming 10^9 chunks and
    a bundle another key signed are FAILED_PRECONDITION, a genuine bundle whose chunk size was altered DATA_LOSS;
    no chunk is read and nothing reaches the replica's disk."""
    from exec_service.server import ExecServerSettings, start_exec_server

    forger = RedisStore(redis_server.url(), tmp_path / "forger", chunk_bytes=CHUNK,
                        signer=Signer.load(generate_key_pair(tmp_path / "other")[0]))
    genuine = RedisStore(redis_server.url(), tmp_path / "genuine", chunk_bytes=CHUNK, signer=signer)
    forged, planted, altered = key_of("forged"), key_of("planted"), key_of("altered")
    commit(forger, forged, os.urandom(16 * CHUNK))
    commit(genuine, altered, os.urandom(16 * CHUNK))
    client = redis_server.client()
    client.hset(f"kiln:bundle:{altered}", "chunk_bytes", 1)
    manifest = bundle.Manifest(key=planted, model="m", config_summary="s", num_pieces=1, num_splits=0, timings={},
                               created_unix=0.0, files={bundle.compiled_layer_file(0): {"sha256": "0" * 64,
                                                                                         "size": 10**9 * CHUNK}})
    client.hset(f"kiln:bundle:{planted}", mapping={
        "manifest": manifest.to_json(), "generation": "c" * 32, "chunk_bytes": CHUNK, "chunks": "[" * 10**6})
    server = BackgroundServer(lambda: start_exec_server(ExecServerSettings(
        "127.0.0.1:0", trusted_keys, None, store=redis_server.url(), cache_dir=tmp_path / "cache")))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    before = getranges(redis_server)
    try:
        stub = exec_pb2_grpc.ExecServiceStub(channel)
        for key, code, says in ((planted, grpc.StatusCode.FAILED_PRECONDITION, "unsigned"),
                                (forged, grpc.StatusCode.FAILED_PRECONDITION, "is not a trusted key here"),
                                (altered, grpc.StatusCode.DATA_LOSS, "its chunk_bytes b'1' is not a number in")):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.LoadModel(exec_pb2.LoadModelRequest(
                    name=f"m{key[:6]}", model=common_pb2.ModelSpec(preset="tiny-llama"),
                    config=common_pb2.CompileConfig(device="cpu"), key=common_pb2.ArtifactKey(digest=key)), timeout=60))
            assert refused.value.code() == code and says in refused.value.details(), refused.value.details()
    finally:
        channel.close()
        server.stop()
    assert getranges(redis_server) == before
    assert not list((tmp_path / "cache").glob("*/*"))
