"""The Redis store against a real redis-server: bounded chunks, atomic commits, leases with fencing, refusal of
altered bytes, an unreachable Redis named in UNAVAILABLE, passwords and TLS, and memory independent of bundle size.

Holders that die or stall are real child processes, killed with SIGKILL or paused with SIGSTOP."""

import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from redis_server import RedisServer

from kiln.store import bundle
from kiln.store.artifact_store import FilesystemStore
from kiln.store.bundle import CorruptBundle
from kiln.store.location import open_store
from kiln.store.redis_store import BATCH_BYTES, RedisStore, StoreUnavailable

CHUNK = 4096
LEASE_S = 1.0
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def writer(server: RedisServer, cache: Path, **kwargs) -> RedisStore:
    return RedisStore(server.url(), cache, lease_s=LEASE_S, chunk_bytes=CHUNK, **kwargs)


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def stage(store, key: str, payload: bytes, signature: bytes | None = b"signed") -> Path:
    """A bundle as the compile pipeline stages one: files, their manifest, and a signature file."""
    staged = store.staging_dir()
    (staged / bundle.compiled_layer_file(0)).write_bytes(payload)
    (staged / bundle.KEY_FACTORS).write_text(json.dumps({"for": key}))
    bundle.write_manifest(staged, key=key, model="tiny", config_summary="test", num_pieces=1, num_splits=0,
                          timings={}, created_unix=time.time())
    if signature is not None:
        (staged / bundle.SIGNATURE).write_bytes(signature)
    return staged


def commit(store: RedisStore, key: str, payload: bytes) -> Path:
    with store.lock(key):
        return store.commit(key, stage(store, key, payload))


def chunk_keys(server: RedisServer, key: str) -> list[bytes]:
    return sorted(server.client().scan_iter(f"kiln:chunk:{key}:*"))


def test_a_committed_bundle_is_read_whole_by_another_replica_in_bounded_chunks(redis_server, tmp_path):
    store = writer(redis_server, tmp_path / "compile-cache")
    key, payload = key_of("a"), os.urandom(10 * CHUNK + 123)
    commit(store, key, payload)

    replica = writer(redis_server, tmp_path / "replica-cache", read_only=True)
    path = replica.get(key)
    assert path is not None and path.parent == tmp_path / "replica-cache"
    assert (path / bundle.compiled_layer_file(0)).read_bytes() == payload
    assert (path / bundle.SIGNATURE).read_bytes() == b"signed"
    assert bundle.verify(path).key == key
    client = redis_server.client()
    sizes = [client.strlen(k) for k in chunk_keys(redis_server, key)]
    assert len(sizes) == 12 and max(sizes) == CHUNK, "bounded chunks, never one huge value"
    assert all(client.ttl(k) == -1 for k in chunk_keys(redis_server, key)), "committed chunks do not expire"

    (listed,) = store.list().artifacts
    assert listed.manifest.key == key and abs(listed.last_used_unix - time.time()) < 60
    assert replica.list() == store.list()
    assert store.delete(key) == len(payload) + len(json.dumps({"for": key}))
    assert replica.get(key) is None and store.list().artifacts == [] and not chunk_keys(redis_server, key)
    assert not (tmp_path / "replica-cache" / key).exists(), "a deleted bundle's local copy goes too"


def test_a_recommit_replaces_the_bundle_and_lets_the_old_chunks_expire(redis_server, tmp_path):
    store = writer(redis_server, tmp_path / "cache")
    key = key_of("b")
    commit(store, key, b"first" * 2000)
    old = set(chunk_keys(redis_server, key))
    commit(store, key, b"second" * 2000)
    client = redis_server.client()
    assert all(0 < client.ttl(k) for k in old), "a reader in the middle of the old chunks can finish"
    replica = writer(redis_server, tmp_path / "replica", read_only=True)
    assert (replica.get(key) / bundle.compiled_layer_file(0)).read_bytes() == b"second" * 2000


HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from kiln.store import bundle
    from kiln.store.redis_store import RedisStore
    url, cache, key, mode = sys.argv[1:5]
    store = RedisStore(url, cache, lease_s=float(sys.argv[5]), chunk_bytes=4096)
    with store.lock(key):
        print("holding", flush=True)
        staged = store.staging_dir()
        if mode == "fifo":  # upload from a pipe the test feeds, so the test can kill us mid-upload
            os.mkfifo(staged / bundle.compiled_layer_file(0))
            size = int(sys.argv[6])
            (staged / bundle.MANIFEST).write_text(bundle.Manifest(
                key=key, model="tiny", config_summary="", num_pieces=1, num_splits=0, timings={}, created_unix=0,
                files={bundle.compiled_layer_file(0): {"sha256": "0" * 64, "size": size}}).to_json())
            print(staged / bundle.compiled_layer_file(0), flush=True)
        else:
            (staged / bundle.compiled_layer_file(0)).write_bytes(b"holder" * 1000)
            (staged / bundle.KEY_FACTORS).write_text("{}")
            bundle.write_manifest(staged, key=key, model="tiny", config_summary="", num_pieces=1, num_splits=0,
                                  timings={}, created_unix=time.time())
            sys.stdin.readline()  # the test says when to commit
        try:
            store.commit(key, staged)
            print("committed", flush=True)
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
""")


def holder(server: RedisServer, cache: Path, key: str, mode: str, *extra: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, server.url(), str(cache), key, mode, str(LEASE_S),
                              *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout.readline().strip() == "holding"
    return child


def test_nothing_half_written_is_visible_when_the_writer_is_killed_mid_upload(redis_server, tmp_path):
    key, size = key_of("c"), BATCH_BYTES + (4 << 20)
    child = holder(redis_server, tmp_path / "child", key, "fifo", str(size))
    fifo = Path(child.stdout.readline().strip())
    with open(fifo, "wb") as pipe:
        pipe.write(b"x" * (BATCH_BYTES + (2 << 20)))  # one batch of chunks goes up, the rest never comes
        pipe.flush()
        deadline = time.monotonic() + 60
        while len(chunk_keys(redis_server, key)) < BATCH_BYTES // CHUNK and time.monotonic() < deadline:
            time.sleep(0.05)
        partial = chunk_keys(redis_server, key)
        assert len(partial) >= BATCH_BYTES // CHUNK, "the writer had uploaded part of the bundle"
        child.kill()
        child.wait()
    client = redis_server.client()
    assert all(0 < client.ttl(k) <= 3600 for k in partial), "orphaned chunks expire on their own"
    reader = writer(redis_server, tmp_path / "reader", read_only=True)
    assert reader.get(key) is None and reader.list().artifacts == []
    assert not client.exists(f"kiln:bundle:{key}")


def test_a_killed_holder_loses_its_lease_after_the_ttl_and_the_next_one_commits(redis_server, tmp_path):
    key = key_of("d")
    child = holder(redis_server, tmp_path / "child", key, "wait")
    child.kill()
    child.wait()
    store = writer(redis_server, tmp_path / "cache")
    started = time.monotonic()
    with store.lock(key):
        waited = time.monotonic() - started
        assert store.get(key) is None, "the killed holder committed nothing"
        store.commit(key, stage(store, key, b"takeover"))
    assert 0.3 * LEASE_S < waited < LEASE_S + 2, f"took over after {waited:.2f}s for a {LEASE_S}s lease"
    reader = writer(redis_server, tmp_path / "r", read_only=True)
    assert (reader.get(key) / bundle.compiled_layer_file(0)).read_bytes() == b"takeover"


def test_a_stalled_holder_whose_lease_was_taken_over_is_fenced_at_commit(redis_server, tmp_path):
    key = key_of("e")
    child = holder(redis_server, tmp_path / "child", key, "wait")
    os.kill(child.pid, signal.SIGSTOP)  # a long GC pause, a frozen VM: alive, but renewing nothing
    try:
        store = writer(redis_server, tmp_path / "cache")
        with store.lock(key):
            store.commit(key, stage(store, key, b"newer"))
    finally:
        os.kill(child.pid, signal.SIGCONT)
    out, _ = child.communicate("commit\n", timeout=60)
    assert out.startswith("LeaseLost") and key in out, out
    replica = writer(redis_server, tmp_path / "replica", read_only=True)
    assert (replica.get(key) / bundle.compiled_layer_file(0)).read_bytes() == b"newer", "the newer commit stands"
    assert len(chunk_keys(redis_server, key)) == 2, "the fenced upload left no chunks behind"


def test_the_same_key_waits_while_different_keys_proceed_at_once(redis_server, tmp_path):
    a, b = writer(redis_server, tmp_path / "a"), writer(redis_server, tmp_path / "b")
    order = []
    with a.lock(key_of("f")):
        with b.lock(key_of("g")):  # another key: no wait
            order.append("other key held at once")

        def same_key():
            with b.lock(key_of("f")):
                order.append("same key after release")

        waiter = threading.Thread(target=same_key)
        waiter.start()
        time.sleep(3 * LEASE_S)  # past the ttl: the lease is renewed while held, so the waiter still waits
        order.append("released")
    waiter.join(timeout=30)
    assert order == ["other key held at once", "released", "same key after release"]


def test_an_altered_chunk_is_refused_by_a_replica_and_removed_by_a_compile_service(redis_server, tmp_path):
    store = writer(redis_server, tmp_path / "compile")
    key = key_of("h")
    commit(store, key, os.urandom(5 * CHUNK))
    victim = chunk_keys(redis_server, key)[2]
    redis_server.client().setrange(victim, 100, b"\x00evil\x00")

    replica = writer(redis_server, tmp_path / "replica", read_only=True)
    with pytest.raises(CorruptBundle, match=rf"{key} in the store {redis_server.url()}.*differs") as refused:
        replica.get(key)
    assert refused.value.code == "DATA_LOSS"
    assert not (tmp_path / "replica" / key).exists() and not list((tmp_path / "replica" / ".staging").iterdir())

    other = writer(redis_server, tmp_path / "other-compile")
    with other.lock(key):
        assert other.get(key) is None, "a compile service sees a miss and compiles it again"
    assert not redis_server.client().exists(f"kiln:bundle:{key}") and store.list().artifacts == []


def test_an_unreachable_store_is_unavailable_naming_it_and_nothing_is_lost(redis_server, tmp_path):
    store = writer(redis_server, tmp_path / "compile")
    key = key_of("i")
    commit(store, key, b"kept" * 5000)
    replica = writer(redis_server, tmp_path / "replica", read_only=True)
    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"store {redis_server.url()} is unreachable") as down:
        replica.get(key)
    assert down.value.code == "UNAVAILABLE" and time.monotonic() - started < 10
    with pytest.raises(StoreUnavailable):
        with store.lock(key_of("j")):
            pass
    redis_server.start()
    assert (replica.get(key) / bundle.compiled_layer_file(0)).read_bytes() == b"kept" * 5000


def test_the_password_comes_from_the_environment_and_never_into_the_location(tmp_path, monkeypatch):
    server = RedisServer(tmp_path / "redis", "--requirepass", "s3cret").start()
    try:
        monkeypatch.delenv("KILN_STORE_PASSWORD", raising=False)
        with pytest.raises(StoreUnavailable, match="refused|unreachable|auth"):
            writer(server, tmp_path / "a").list()
        monkeypatch.setenv("KILN_STORE_PASSWORD", "s3cret")
        store = writer(server, tmp_path / "b")
        commit(store, key_of("k"), b"secret-protected")
        assert [a.manifest.key for a in store.list().artifacts] == [key_of("k")]
        in_url = RedisStore(f"redis://user:s3cret@127.0.0.1:{server.port}/0", tmp_path / "c")
        assert in_url.location == f"redis://127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (ca.pem, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - day).not_valid_after(now + day)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("kiln test ca", ca_key, "kiln test ca", ca_key, True)
    server = certificate("127.0.0.1", server_key, "kiln test ca", ca_key, False)
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return paths


def test_rediss_speaks_tls_to_a_server_that_requires_it(tmp_path):
    ca, cert, key = _certificates(tmp_path)
    server = RedisServer(tmp_path / "redis", tls=(ca, cert, key)).start()
    try:
        store = RedisStore(f"{server.url()}?ssl_ca_certs={ca}", tmp_path / "cache", lease_s=LEASE_S, chunk_bytes=CHUNK)
        assert store.location == server.url(), "the location names no query (it may carry secrets)"
        commit(store, key_of("tls"), b"over tls")
        assert [a.manifest.key for a in store.list().artifacts] == [key_of("tls")]
        with pytest.raises(StoreUnavailable):  # plain text to a TLS-only port is not a store
            RedisStore(f"redis://127.0.0.1:{server.port}/0", tmp_path / "plain").list()
    finally:
        server.stop()


def test_store_locations_open_the_backend_they_name(tmp_path):
    assert isinstance(open_store(tmp_path / "dir", tmp_path / "cache"), FilesystemStore)
    remote = open_store("redis://127.0.0.1:1/2", tmp_path / "cache", read_only=True, lease_s=7)
    assert isinstance(remote, RedisStore) and remote.read_only and remote.lease_s == 7
    with pytest.raises(ValueError, match="s3:// is not a store"):
        open_store("s3://bucket/prefix", tmp_path / "cache")


PEAK_RSS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kiln.store.redis_store import RedisStore

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    url, cache, key, mode = sys.argv[1:5]
    store = RedisStore(url, cache, read_only=mode == "read", lease_s=30)
    store.list()  # connected, everything imported: the baseline
    before = peak_kib()
    if mode == "write":
        with store.lock(key):
            store.commit(key, Path(sys.argv[5]))
    else:
        assert store.get(key) is not None
    print(json.dumps({"growth_kib": peak_kib() - before}))
""")


def test_memory_stays_bounded_while_a_50_mb_bundle_streams_in_and_out(redis_server, tmp_path):
    key, size = key_of("big"), 50 << 20
    staging = FilesystemStore(tmp_path / "writer")
    staged = staging.staging_dir()
    with open(staged / bundle.compiled_layer_file(0), "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    (staged / bundle.KEY_FACTORS).write_text("{}")
    bundle.write_manifest(staged, key=key, model="big", config_summary="", num_pieces=1, num_splits=0, timings={},
                          created_unix=time.time())
    growth = {}
    for mode, cache, extra in (("write", tmp_path / "writer", [str(staged)]), ("read", tmp_path / "reader", [])):
        result = subprocess.run([sys.executable, "-c", PEAK_RSS, redis_server.url(), str(cache), key, mode, *extra],
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 0, result.stderr
        growth[mode] = json.loads(result.stdout)["growth_kib"] / 1024
    assert (tmp_path / "reader" / key / bundle.compiled_layer_file(0)).stat().st_size == size
    # Chunks of 1 MiB, batches of 4 MiB: the peak grows by a few batches (measured: ~4 MiB writing, ~12 MiB
    # reading), not by the bundle's 50 MiB.
    assert growth["write"] < 20 and growth["read"] < 20, f"peak RSS growth in MiB for a 50 MiB bundle: {growth}"
    shutil.rmtree(tmp_path / "writer")


def test_a_compile_service_signs_what_it_commits_and_counts_only_trusted_bundles(redis_server, tmp_path):
    from kiln.store.signing import Signer, TrustedKeys, generate_key_pair

    ours, _ = generate_key_pair(tmp_path / "ours")
    other, _ = generate_key_pair(tmp_path / "other")
    trusted = TrustedKeys.load(tmp_path / "ours" / "signing.pub")
    signing = writer(redis_server, tmp_path / "a", signer=Signer.load(ours), trusted=trusted)
    key = key_of("signed")
    commit(signing, key, b"signed payload")
    replica = writer(redis_server, tmp_path / "replica", read_only=True)
    assert bundle.verify_signed(replica.get(key), key, trusted).key == key, "the signature travels with the bundle"

    forger = writer(redis_server, tmp_path / "forger", signer=Signer.load(other))
    forged = key_of("forged")
    commit(forger, forged, b"planted")
    with signing.lock(forged):
        assert signing.get(forged) is None, "a bundle no trusted key signed is no hit: it is compiled again"
    assert not redis_server.client().exists(f"kiln:bundle:{forged}")
    assert [a.manifest.key for a in signing.list().artifacts] == [key]
