"""The artifact store on Redis: bundles shared by compile services and execute replicas on many hosts.

Layout (``K`` is an artifact key, ``G`` a generation: a fresh id for each commit of ``K``):
- ``kiln:bundle:K``  hash: ``manifest`` (the exact bytes of manifest.json), ``signature`` (manifest.sig's bytes,
  absent for an unsigned bundle), ``generation`` G, ``chunks`` (JSON: file name -> number of chunks), ``fence``
  (the fencing token of the commit), ``committed_unix``.
- ``kiln:chunk:K:G:NAME:I``  string: the I-th chunk of file NAME, at most ``chunk_bytes`` (never one huge value).
- ``kiln:index``  sorted set: K scored by its last-used time, for ListArtifacts and for eviction by age.
- ``kiln:lease:K`` / ``kiln:fence:K``: single-flight across compile services (kiln/store/redis_lease.py).

A commit uploads every chunk under a new generation with an expiry (orphans of a writer killed mid-upload vanish on
their own), then in one MULTI/EXEC, watched on the fence: makes the chunks permanent, points the hash at them and
scores the index. Nothing half-written is ever visible, and a writer whose lease was taken over is refused. The
previous generation's chunks expire after a grace period, so a reader in the middle of them can finish.

Redis is untrusted storage: a bundle is read into a verified local copy (sizes and sha256s checked while the
chunks stream to disk; the signature is checked where it is loaded) and only that copy is ever used. Memory stays
bounded by a few chunks whatever the bundle's size. Single Redis (or a Sentinel/replicated primary): the commit
touches keys of several hash slots, so Redis Cluster is not supported.
"""

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kiln.errors import Unavailable
from kiln.store import bundle
from kiln.store.artifact_store import FilesystemStore, StoredArtifact, is_key
from kiln.store.bundle import CorruptBundle, Manifest, UntrustedBundle
from kiln.store.redis_lease import Lease
from kiln.store.signing import Signer, TrustedKeys

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
BATCH_BYTES = 4 << 20  # chunks per round trip: few round trips, memory bounded by a few batches
PENDING_S = 3600  # how long the chunks of an uncommitted upload live
SUPERSEDED_GRACE_S = 300  # how long a replaced generation's chunks stay for readers in the middle of them
DEFAULT_LEASE_S = 30.0


class StoreUnavailable(Unavailable):
    """Redis cannot be reached or refused the connection: UNAVAILABLE, naming the store."""


class LeaseLost(Unavailable):
    """This compile service's lease on a key was taken over: its commit is refused, the newer holder's stands."""


def redacted(url: str) -> str:
    """The URL without user name and password, for messages, logs and spans."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class RedisStore:
    """Bundles in Redis, with verified local copies under ``cache_dir``.

    ``read_only`` (an execute replica): never writes Redis, refuses a corrupt bundle (DATA_LOSS) instead of
    removing it, and takes no leases; the signature of what it reads is checked where the bundle is loaded. A writer
    (a compile service) signs every commit with ``signer``, takes a bundle as present only when its signature
    verifies against ``trusted``, and removes a corrupt or untrusted bundle so it is rebuilt.
    """

    def __init__(self, url: str, cache_dir: Path | str, *, read_only: bool = False, lease_s: float = DEFAULT_LEASE_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, signer: Signer | None = None,
                 trusted: TrustedKeys | None = None):
        self.location = redacted(url)
        self.read_only = read_only
        self.signer = signer
        self.trusted = trusted
        self.lease_s = lease_s
        self.chunk_bytes = chunk_bytes
        password = os.environ.get("KILN_STORE_PASSWORD") or None
        extra = {"password": password} if password else {}
        # A few quick retries ride out a dropped connection; a Redis that stays down is UNAVAILABLE within seconds.
        self.client = redis.Redis.from_url(
            url, socket_connect_timeout=2, socket_timeout=30, health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2), **extra)
        self.cache = FilesystemStore(cache_dir)
        self._thread_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._held: dict[str, Lease] = {}  # key -> this process's lease while it is held

    # --- single flight ---------------------------------------------------------------------------------------

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Exclusive per key across every process on this Redis (a lease), and across threads of this one."""
        with self._guard:
            thread_lock = self._thread_locks.setdefault(key, threading.Lock())
        with thread_lock:
            if self.read_only:
                yield
                return
            lease = Lease(self.client, f"kiln:lease:{key}", f"kiln:fence:{key}", self.lease_s)
            with self._reachable():
                lease.acquire()
            self._held[key] = lease
            try:
                yield
            finally:
                del self._held[key]
                lease.release()

    # --- reading ---------------------------------------------------------------------------------------------

    def get(self, key: str, check: bool = True) -> Path | None:
        """The bundle as a verified local copy, or None when Redis has none. ``check=False`` leaves an up-to-date
        local copy unhashed, for a reader that hashes as it reads (GetArtifact)."""
        self._check(key)
        with self._reachable():
            for _ in range(2):  # a second try when a newer commit replaced the chunks being read
                entry = self._entry(key)
                if entry is None:
                    self.cache.delete(key)  # deleted from the store: not a hit anywhere any more
                    return None
                local = self.cache.get(key, check)
                if local is not None and (local / bundle.MANIFEST).read_bytes() == entry[b"manifest"]:
                    self.touch(key)
                    return local
                try:
                    path = self._download(key, entry)
                except _Superseded:
                    continue
                except (CorruptBundle, UntrustedBundle) as exc:
                    return self._corrupt(key, entry, exc)
                self.touch(key)
                return path
        raise CorruptBundle(f"bundle {key} in the store {self.location} changed twice while it was read")

    def quarantine(self, key: str, reason: str) -> None:
        """The local copy failed a check at load: set it aside; the next get downloads the bundle again."""
        self.cache.quarantine(key, reason)

    def touch(self, key: str) -> None:
        if not self.read_only:
            with self._reachable():
                self.client.zadd("kiln:index", {key: time.time()}, xx=True)

    # --- writing ---------------------------------------------------------------------------------------------

    def staging_dir(self) -> Path:
        return self.cache.staging_dir()

    def discard(self, staged: Path) -> None:
        self.cache.discard(staged)

    def commit(self, key: str, staged: Path) -> Path:
        """Upload a fully written bundle and publish it atomically, if this process's lease on ``key`` still
        stands; the staged directory becomes the local copy."""
        self._check(key)
        lease = self._held.get(key)
        if self.read_only or lease is None:
            raise RuntimeError(f"commit of {key[:12]} without holding its lease in {self.location}")
        if self.signer is not None:
            bundle.sign(staged, self.signer)
        manifest_bytes = (staged / bundle.MANIFEST).read_bytes()
        signature_path = staged / bundle.SIGNATURE
        signature = signature_path.read_bytes() if signature_path.exists() else None
        manifest = Manifest.from_json(manifest_bytes.decode())
        generation = uuid.uuid4().hex
        with self._reachable():
            chunks = {name: self._upload(key, generation, name, staged / name) for name in sorted(manifest.files)}
            self._publish(key, lease, generation, chunks, manifest_bytes, signature)
        return self.cache.commit(key, staged)

    def delete(self, key: str) -> int:
        """Remove a bundle from Redis and the local copy; the bytes freed in Redis (0 when it was not there)."""
        self._check(key)
        if self.read_only:
            raise RuntimeError(f"delete of {key[:12]} through a read-only view of {self.location}")
        with self.lock(key), self._reachable():
            entry = self._entry(key)
            self.cache.delete(key)
            if entry is None:
                return 0
            freed = Manifest.from_json(entry[b"manifest"].decode()).total_bytes
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(f"kiln:bundle:{key}", *self._chunk_keys(key, entry))
            pipe.zrem("kiln:index", key)
            pipe.execute()
        return freed

    # --- internals -------------------------------------------------------------------------------------------

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"store {self.location} is unreachable: {exc}") from None
        except redis.ResponseError as exc:  # NOAUTH, WRONGPASS, READONLY replica, out of memory
            raise StoreUnavailable(f"store {self.location} refused the request: {exc}") from None

    @staticmethod
    def _check(key: str) -> None:
        if not is_key(key):
            raise ValueError(f"not an artifact key: {key!r}")

    def _entry(self, key: str) -> dict[bytes, bytes] | None:
        entry = self.client.hgetall(f"kiln:bundle:{key}")
        return entry if entry and b"manifest" in entry else None

    def _chunk_keys(self, key: str, entry: dict[bytes, bytes]) -> list[str]:
        generation = entry.get(b"generation", b"").decode()
        counts = json.loads(entry.get(b"chunks", b"{}"))
        return [f"kiln:chunk:{key}:{generation}:{name}:{i}" for name, n in counts.items() for i in range(n)]

    def _upload(self, key: str, generation: str, name: str, path: Path) -> int:
        """One file as chunks that expire unless a commit makes them permanent; returns the number of chunks."""
        count, batched = 0, 0
        pipe = self.client.pipeline(transaction=False)
        with open(path, "rb") as f:
            while chunk := f.read(self.chunk_bytes):
                pipe.set(f"kiln:chunk:{key}:{generation}:{name}:{count}", chunk, ex=PENDING_S)
                count, batched = count + 1, batched + len(chunk)
                if batched >= BATCH_BYTES:
                    pipe.execute()
                    batched = 0
        pipe.execute()
        return count

    def _publish(self, key: str, lease: Lease, generation: str, chunks: dict[str, int], manifest: bytes,
                 signature: bytes | None) -> None:
        """Make the new generation the bundle, atomically, if no newer lease was granted since ours."""
        fence_key, bundle_key = f"kiln:fence:{key}", f"kiln:bundle:{key}"
        new_chunks = [f"kiln:chunk:{key}:{generation}:{name}:{i}" for name, n in chunks.items() for i in range(n)]
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(fence_key, bundle_key)
                    fence = int(pipe.get(fence_key) or 0)
                    if fence != lease.token or lease.lost.is_set():
                        pipe.unwatch()
                        if new_chunks:
                            self.client.delete(*new_chunks)
                        raise LeaseLost(f"store {self.location}: the lease on {key} passed to another compile "
                                        f"service (fence {fence}, ours {lease.token}); this compile was not "
                                        f"committed, the other one's stands")
                    old = pipe.hgetall(bundle_key)
                    pipe.multi()
                    for chunk_key in new_chunks:
                        pipe.persist(chunk_key)
                    for chunk_key in self._chunk_keys(key, old) if old else []:
                        pipe.expire(chunk_key, SUPERSEDED_GRACE_S)
                    pipe.delete(bundle_key)
                    pipe.hset(bundle_key, mapping={
                        "manifest": manifest, "generation": generation, "chunks": json.dumps(chunks),
                        "fence": lease.token, "committed_unix": time.time(),
                        **({"signature": signature} if signature is not None else {})})
                    pipe.zadd("kiln:index", {key: time.time()})
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def _download(self, key: str, entry: dict[bytes, bytes]) -> Path:
        """Stream every file of ``entry`` to a local staging directory, checking sizes and sha256s as it goes."""
        try:
            manifest = Manifest.from_json(entry[b"manifest"].decode())
            counts = json.loads(entry[b"chunks"])
            generation = entry[b"generation"].decode()
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptBundle(f"bundle {key} in the store {self.location}: unreadable entry ({exc})") from None
        if manifest.key != key or set(counts) != set(manifest.files):
            raise CorruptBundle(f"bundle {key} in the store {self.location}: its manifest does not describe it")
        staged = self.cache.staging_dir()
        try:
            for name, expected in manifest.files.items():
                self._download_file(key, generation, name, counts[name], expected, staged / name)
            (staged / bundle.MANIFEST).write_bytes(entry[b"manifest"])
            if b"signature" in entry:
                (staged / bundle.SIGNATURE).write_bytes(entry[b"signature"])
            if self.trusted is not None:
                bundle.verify_signed(staged, key, self.trusted)
            return self.cache.commit(key, staged)
        except BaseException:
            self.cache.discard(staged)
            raise

    def _download_file(self, key: str, generation: str, name: str, count: int, expected: dict, dest: Path) -> None:
        digest, size = hashlib.sha256(), 0
        per_batch = max(1, BATCH_BYTES // self.chunk_bytes)
        with open(dest, "wb") as f:
            for start in range(0, count, per_batch):
                pipe = self.client.pipeline(transaction=False)
                for i in range(start, min(count, start + per_batch)):
                    pipe.get(f"kiln:chunk:{key}:{generation}:{name}:{i}")
                for chunk in pipe.execute():
                    if chunk is None:
                        if self.client.hget(f"kiln:bundle:{key}", "generation") != generation.encode():
                            raise _Superseded
                        raise CorruptBundle(f"bundle {key} in the store {self.location}: {name} has a missing chunk")
                    size += len(chunk)
                    if size > expected["size"]:
                        raise CorruptBundle(f"bundle {key} in the store {self.location}: {name} is larger than "
                                            f"its manifest's {expected['size']} bytes")
                    digest.update(chunk)
                    f.write(chunk)
        if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
            raise CorruptBundle(f"bundle {key} in the store {self.location}: {name} differs from its manifest's "
                                f"size and sha256")

    def _corrupt(self, key: str, entry: dict[bytes, bytes], exc: CorruptBundle | UntrustedBundle) -> None:
        """A reader refuses a corrupt bundle; a writer removes it, or one its keys do not verify (if no commit
        replaced it meanwhile), so it is compiled again."""
        if self.read_only:
            raise exc
        log.warning("%s; removing it so that it is compiled again", exc)
        with contextlib.suppress(redis.WatchError), self.client.pipeline(transaction=True) as pipe:
            pipe.watch(f"kiln:bundle:{key}")
            if pipe.hget(f"kiln:bundle:{key}", "generation") == entry.get(b"generation"):
                pipe.multi()
                pipe.delete(f"kiln:bundle:{key}", *self._chunk_keys(key, entry))
                pipe.zrem("kiln:index", key)
                pipe.execute()
        return None

    # Last: as a method name, ``list`` would shadow the builtin in the annotations of the methods after it.
    def list(self) -> list[StoredArtifact]:
        out = []
        with self._reachable():
            scored = self.client.zrange("kiln:index", 0, -1, withscores=True)
            for start in range(0, len(scored), 256):
                batch = scored[start:start + 256]
                pipe = self.client.pipeline(transaction=False)
                for member, _ in batch:
                    pipe.hget(f"kiln:bundle:{member.decode()}", "manifest")
                for (member, last_used), manifest in zip(batch, pipe.execute(), strict=True):
                    if manifest is None:
                        continue  # deleted between the two reads
                    try:
                        out.append(StoredArtifact(Manifest.from_json(manifest.decode()), last_used))
                    except (ValueError, TypeError):
                        log.warning("store %s: unreadable manifest for %s", self.location, member.decode()[:12])
        return sorted(out, key=lambda a: a.manifest.key)


class _Superseded(Exception):
    """The generation being read was replaced by a newer commit: read the bundle again."""
