"""Many replicas on one Redis store: two compile services and three execute replicas, all real.

Compile services A and B are child processes (``kiln compile-server --store redis://...``) tracing to a real OTLP
receiver; replicas 1 and 2 run in this process and ask A and B; replica 3 is a child process
(``kiln exec-server --store redis://...``) with no compile service at all. Leases are short (LEASE_S) so a takeover
takes seconds. The compiles are the tiny model's, whose Inductor pieces the rest of the suite has usually cached."""

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import TINY_CONFIG, TINY_MODEL, BackgroundServer, otel_env
from google.protobuf import json_format
from redis_server import RedisServer

from kiln.compilation import cache_key
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store import bundle
from kiln.store.redis_store import RedisStore
from kiln_cli.service_process import ServiceProcess, free_port, kiln_command
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc
from tracing import spans

LEASE_S = 3.0
SMALL_KV = 1 << 20  # replicas' KV caches stay small, so memory measurements see the bundle, not the cache
TAKEOVER_CONFIG = common_pb2.CompileConfig(device="cpu", compile_sizes=[4, 8], max_num_batched_tokens=128)


class Cluster:
    def __init__(self, root: Path, otlp_endpoint: str, signing_dir: Path):
        from kiln.store.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, TrustedKeys

        self.root = root
        self.signing_key = signing_dir / PRIVATE_KEY_FILE
        self.public_key = signing_dir / PUBLIC_KEY_FILE
        self.trusted = TrustedKeys.load(self.public_key)
        self.redis = RedisServer(root / "redis").start()
        self.url = self.redis.url()
        self.env = otel_env(otlp_endpoint)
        self.compile = {name: self._compile_service(name) for name in ("A", "B")}
        self.replica3 = self._service("replica3", "exec-server", "--store", self.url, "--cache",
                                      str(root / "replica3-cache"), "--trusted-keys", str(self.public_key))
        for service in (*self.compile.values(), self.replica3):
            service.start()
        for service in (*self.compile.values(), self.replica3):
            service.wait_healthy(timeout=180)
        from exec_service.server import ExecServerSettings, start_exec_server

        self.replicas = {
            n: BackgroundServer(lambda n=n, a=a: start_exec_server(ExecServerSettings(
                "127.0.0.1:0", self.trusted, a.address, store=self.url, cache_dir=root / f"replica{n}-cache")))
            for n, a in ((1, self.compile["A"]), (2, self.compile["B"]))}
        self.channels = []

    def _compile_service(self, name: str) -> ServiceProcess:
        return self._service(f"compile{name}", "compile-server", "--store", self.url, "--cache",
                             str(self.root / f"compile{name}-cache"), "--lease-s", str(LEASE_S),
                             "--signing-key", str(self.signing_key))

    def _service(self, name: str, command: str, *args: str) -> ServiceProcess:
        port = free_port()
        return ServiceProcess(name, kiln_command(command, "--host", "127.0.0.1", "--port", str(port), *args),
                              f"127.0.0.1:{port}", self.root / f"{name}.log", self.env)

    def channel(self, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.channels.append(channel)
        return channel

    def exec_stub(self, replica: int) -> exec_pb2_grpc.ExecServiceStub:
        address = self.replica3.address if replica == 3 else self.replicas[replica].address
        return exec_pb2_grpc.ExecServiceStub(self.channel(address))

    def compile_stub(self, name: str) -> compile_pb2_grpc.CompileServiceStub:
        return compile_pb2_grpc.CompileServiceStub(self.channel(self.compile[name].address))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for replica in self.replicas.values():
            replica.stop()
        for service in (self.replica3, *self.compile.values()):
            service.kill()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, otlp_receiver, signing_dir):
    cluster = Cluster(tmp_path_factory.mktemp("replicas"), otlp_receiver.endpoint, signing_dir)
    yield cluster
    cluster.close()


def load(stub, name: str, config=TINY_CONFIG, **fields) -> list:
    request = exec_pb2.LoadModelRequest(name=name, model=TINY_MODEL, config=config, kv_cache_bytes=SMALL_KV, **fields)
    events = list(stub.LoadModel(request))
    assert events[-1].HasField("ready"), events
    return events


def fetch_details(events) -> list[str]:
    return [e.phase.detail for e in events if e.HasField("phase") and e.phase.phase == "fetch"]


def greedy(stub, model: str) -> list[int]:
    request = exec_pb2.GenerateRequest(model=model, prompt_ids=[3, 1, 4, 1, 5], max_tokens=6, temperature=0.0,
                                       ignore_eos=True)
    return [t for response in stub.Generate(request) for t in response.token_ids]


def compile_spans(receiver, key: str) -> list:
    return [s for s in receiver.spans() if s.name == spans.COMPILE and s.attributes.get(spans.CACHE_KEY) == key
            and s.resource.get("service.name") == "kiln-compile"]


@pytest.fixture(scope="module")
def first_loads(cluster):
    """Three LoadModels of a model the store has never seen, at once: two on replica 1 (asking A), one on
    replica 2 (asking B)."""
    jobs = ((1, "tiny-a"), (2, "tiny-a"), (1, "tiny-b"))
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: load(cluster.exec_stub(job[0]), job[1]), jobs))


def test_three_concurrent_loads_through_two_compile_services_compile_once(cluster, first_loads, otlp_receiver):
    keys = {e.ready.key.digest for events in first_loads for e in events[-1:]}
    assert len(keys) == 1
    (key,) = keys
    details = [d for events in first_loads for d in fetch_details(events)]
    compiled = [d for d in details if d.startswith("compile service: compiled in")]
    hits = [d for d in details if d.startswith("compile service: hit")]
    assert len(compiled) == 1 and len(hits) == 2, details
    # Both compile services traced their calls: one compile span says it compiled, the other two are hits.
    otlp_receiver.wait_for(lambda r: len(compile_spans(r, key)) >= 3)
    outcomes = sorted(s.attributes[spans.CACHE_HIT] for s in compile_spans(otlp_receiver, key))
    assert outcomes == [False, True, True]
    listed = RedisStore(cluster.url, cluster.root / "lister", read_only=True).list().artifacts
    assert [a.manifest.key for a in listed] == [key]


def test_a_replica_without_a_compile_service_loads_from_the_store(cluster, first_loads):
    key = first_loads[0][-1].ready.key.digest
    stub = cluster.exec_stub(3)
    events = load(stub, "tiny-from-store")
    assert events[-1].ready.key.digest == key
    assert f"shared store {cluster.url}, key {key}" in fetch_details(events)
    assert greedy(stub, "tiny-from-store") == greedy(cluster.exec_stub(1), "tiny-a"), "same bundle, same tokens"


def test_a_replica_without_a_compile_service_names_a_missing_key(cluster):
    stub = cluster.exec_stub(3)
    missing = hashlib.sha256(b"never compiled").hexdigest()
    with pytest.raises(grpc.RpcError) as exc:
        load(stub, "tiny-missing", key=common_pb2.ArtifactKey(digest=missing))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert missing in exc.value.details() and cluster.url in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:  # by model and config: the key this replica would have asked for
        load(stub, "tiny-uncompiled", config=common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=64))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "no compile service" in exc.value.details()


@pytest.fixture(scope="module")
def takeover(cluster):
    """A starts compiling a new model and is killed with SIGKILL while it holds the lease; B is asked the same."""
    request = compile_pb2.CompileRequest(model=TINY_MODEL, config=TAKEOVER_CONFIG)
    call = cluster.compile_stub("A").Compile(request)
    for event in call:
        if event.HasField("progress") and event.progress.phase in ("trace", "inductor"):
            break  # past the key and the lease: A is compiling
    cluster.compile["A"].process.kill()
    cluster.compile["A"].process.wait()
    call.cancel()
    killed_at = time.monotonic()
    events = list(cluster.compile_stub("B").Compile(request))
    return events, time.monotonic() - killed_at


def test_a_compile_service_killed_mid_compile_is_taken_over_after_its_lease(cluster, takeover):
    events, _ = takeover
    result = events[-1].result
    assert not result.cache_hit, "A committed nothing: B compiled"
    trace = next(e.progress for e in events if e.HasField("progress") and e.progress.phase == "trace")
    # B waited for A's lease (renewed every LEASE_S / 3 until the kill) to expire before it compiled.
    assert LEASE_S / 3 < trace.elapsed_s < LEASE_S + 10, trace
    reader = RedisStore(cluster.url, cluster.root / "takeover-reader", read_only=True)
    path = reader.get(result.key.digest)
    assert bundle.verify(path).key == result.key.digest, "the bundle is whole"
    stub = cluster.exec_stub(3)
    load(stub, "tiny-takeover", config=TAKEOVER_CONFIG, key=result.key)
    assert len(greedy(stub, "tiny-takeover")) == 6


def test_altered_chunks_in_redis_are_refused_and_never_loaded(cluster, takeover):
    key = takeover[0][-1].result.key.digest
    client = cluster.redis.client()
    entry = client.hgetall(f"kiln:bundle:{key}")
    victim = f"kiln:chunk:{key}:{entry[b'generation'].decode()}:{bundle.compiled_layer_file(0)}:0"
    original = client.getrange(victim, 0, 15)
    client.setrange(victim, 0, bytes(b ^ 0xFF for b in original))
    try:
        stub = cluster.exec_stub(2)  # replica 2 has never fetched this bundle
        with pytest.raises(grpc.RpcError) as exc:
            load(stub, "tiny-altered", config=TAKEOVER_CONFIG, key=common_pb2.ArtifactKey(digest=key))
        assert exc.value.code() == grpc.StatusCode.DATA_LOSS
        assert key in exc.value.details() and cluster.url in exc.value.details()
        assert not (cluster.root / "replica2-cache" / key).exists()
        (model,) = [m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models if m.name == "tiny-altered"]
        assert model.state == exec_pb2.MODEL_STATE_FAILED
    finally:
        client.setrange(victim, 0, original)


def plant(cluster, source_key: str, key: str | None, signing_key: Path, padding_mib: int = 0) -> str:
    """Commit to Redis, under ``key``, the bundle of ``source_key`` (plus listed padding), signed with
    ``signing_key``: what any writer of the store could put there. With no ``key``, the factors say which padding
    the bundle carries and the key is their digest, as a compile service's would be."""
    from kiln.store.signing import Signer

    source = RedisStore(cluster.url, cluster.root / f"source-{source_key[:8]}", read_only=True).get(source_key)
    manifest = json.loads((source / bundle.MANIFEST).read_text())
    factors = json.loads((source / bundle.KEY_FACTORS).read_text())
    if key is None:
        factors["padding_mib"] = padding_mib
        key = cache_key.digest(factors)
    writer = RedisStore(cluster.url, cluster.root / f"writer-{key[:8]}", lease_s=LEASE_S,
                        signer=Signer.load(signing_key))
    with writer.lock(key):
        staged = writer.staging_dir()
        for name in manifest["files"]:
            (staged / name).write_bytes((source / name).read_bytes())
        (staged / bundle.KEY_FACTORS).write_text(json.dumps(factors))
        if padding_mib:
            with open(staged / "padding.bin", "wb") as f:
                for _ in range(padding_mib):
                    f.write(os.urandom(1 << 20))
        bundle.write_manifest(staged, **{k: v for k, v in manifest.items() if k != "files"} | {"key": key})
        writer.commit(key, staged)
    return key


def test_a_bundle_in_redis_signed_by_an_untrusted_key_is_refused_and_never_loaded(cluster, first_loads, tmp_path):
    """Whoever can write Redis can write a consistent bundle (every sha256 right), but cannot sign it."""
    from kiln.store.signing import PRIVATE_KEY_FILE, generate_key_pair

    generate_key_pair(tmp_path / "attacker")
    forged = hashlib.sha256(b"a bundle an attacker planted").hexdigest()
    plant(cluster, first_loads[0][-1].ready.key.digest, forged, tmp_path / "attacker" / PRIVATE_KEY_FILE)
    stub = cluster.exec_stub(3)
    with pytest.raises(grpc.RpcError) as exc:
        load(stub, "tiny-forged", key=common_pb2.ArtifactKey(digest=forged))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert forged in exc.value.details() and "signer" in exc.value.details()
    (model,) = [m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models if m.name == "tiny-forged"]
    assert model.state == exec_pb2.MODEL_STATE_FAILED


def test_a_redis_restart_fails_one_load_with_unavailable_and_the_next_succeeds(cluster, first_loads, takeover):
    stub = cluster.exec_stub(3)
    cluster.redis.stop()
    try:
        with pytest.raises(grpc.RpcError) as exc:
            load(stub, "tiny-outage")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"store {cluster.url}" in exc.value.details()
    finally:
        cluster.redis.start()
    load(stub, "tiny-outage")
    assert len(greedy(stub, "tiny-outage")) == 6
    # Nothing was corrupted: both bundles read back whole by a replica that never saw them.
    reader = RedisStore(cluster.url, cluster.root / "after-restart", read_only=True)
    for key in (first_loads[0][-1].ready.key.digest, takeover[0][-1].result.key.digest):
        assert bundle.verify(reader.get(key)).key == key


def _memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def test_a_replica_streams_a_50_mb_bundle_from_redis_in_bounded_memory(cluster, first_loads):
    """The tiny model's bundle plus 50 MiB of listed, hashed padding, under a key of its own (its factors say so, so
    that they hash to it): replica 3 (a child
    process) copies it from Redis to disk while its peak RSS grows by a fraction of that."""
    big_key = plant(cluster, first_loads[0][-1].ready.key.digest, None, cluster.signing_key, padding_mib=50)

    pid = cluster.replica3.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _memory_kib(pid)
    load(cluster.exec_stub(3), "tiny-big", key=common_pb2.ArtifactKey(digest=big_key))
    after = _memory_kib(pid)
    growth_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
    assert (cluster.root / "replica3-cache" / big_key / "padding.bin").stat().st_size == 50 << 20
    assert growth_mib < 25, f"replica's peak RSS grew {growth_mib:.1f} MiB for a 50 MiB bundle"


def test_a_replica_started_with_load_requests_serves_them_without_a_load_model_call(cluster, first_loads):
    """``exec-server --load JSON``: the replica an autoscaler adds loads its models from the store by itself, and
    each model's health entry (a per-model readiness probe) turns SERVING once it is ready."""
    from exec_service.api.servicer import health_name
    from exec_service.server import ExecServerSettings, start_exec_server
    from kiln_cli.exec_commands import load_request_json
    from kiln_cli.health_commands import check

    wanted = load_request_json(json.dumps({"name": "tiny-preloaded", "model": {"preset": "tiny-llama"},
                                           "config": json.loads(json_format.MessageToJson(TINY_CONFIG)),
                                           "kvCacheBytes": str(SMALL_KV)}))
    missing = exec_pb2.LoadModelRequest(name="tiny-not-there", model=TINY_MODEL, config=TAKEOVER_CONFIG,
                                        key=common_pb2.ArtifactKey(digest=hashlib.sha256(b"absent").hexdigest()))
    replica = BackgroundServer(lambda: start_exec_server(ExecServerSettings(
        "127.0.0.1:0", cluster.trusted, store=cluster.url, cache_dir=cluster.root / "preloaded-cache",
        preload=(wanted, missing))))
    try:
        deadline = time.monotonic() + 120
        while check(replica.address, health_name("tiny-preloaded")) != "SERVING":
            assert time.monotonic() < deadline, "the preloaded model never became ready"
            time.sleep(0.2)
        stub = exec_pb2_grpc.ExecServiceStub(cluster.channel(replica.address))
        assert greedy(stub, "tiny-preloaded") == greedy(cluster.exec_stub(1), "tiny-a")
        models = {m.name: m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models}
        assert models["tiny-not-there"].state == exec_pb2.MODEL_STATE_FAILED
        assert missing.key.digest in models["tiny-not-there"].error
        assert check(replica.address, health_name("tiny-not-there")) == "NOT_SERVING"
    finally:
        replica.stop()
