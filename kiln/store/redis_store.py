"""The artifact store on Redis: bundles shared by compile services and execute replicas on many hosts.

Layout (``K`` is an artifact key, ``G`` a generation: a fresh id for each commit of ``K``):
- ``kiln:bundle:K``  hash: ``manifest`` (the exact bytes of manifest.json), ``signature`` (manifest.sig's bytes,
  absent for an unsigned bundle), ``generation`` G, ``chunk_bytes`` (every chunk's size but a file's last),
  ``chunks`` (JSON: file name -> number of chunks, for readers of Kiln before ``chunk_bytes``; never read), ``fence``
  (the fencing token of the commit), ``committed_unix``.
- ``kiln:chunk:K:G:NAME:I``  string: the I-th chunk of file NAME, at most ``chunk_bytes`` (never one huge value).
- ``kiln:index``  sorted set: K scored by its last-used time, for ListArtifacts and for eviction by age.
- ``kiln:lease:K`` / ``kiln:fence:K``: single-flight across compile services (kiln/store/redis_lease.py).

A commit uploads every chunk under a new generation with an expiry (orphans of a writer killed mid-upload vanish on
their own), then in one MULTI/EXEC, watched on the fence: makes the chunks permanent, points the hash at them and
scores the index. Nothing half-written is ever visible, and a writer whose lease was taken over is refused. The
previous generation's chunks expire after a grace period, so a reader in the middle of them can finish.

Redis is untrusted storage, and so is every field of it: whoever can write Redis can write a chunk count of 10^9,
a manifest of a gigabyte or a hash where a string belongs. So an entry is read by a script that returns no field
over its bound; its manifest's signature is checked (with ``trusted`` keys) before a single chunk is read; the
number and size of the chunks follow from that manifest and ``chunk_bytes``, each within configured maxima, and each
chunk is read no longer than it may be. A bundle is read into a verified local copy (sizes and sha256s checked
while the chunks stream to disk) and only that copy is ever used. An entry that fails any of this is DATA_LOSS for
that key alone: a reader refuses it, a writer removes it (finding its chunks by a scan, not by what it says), and
``list`` reports it as unreadable beside the others. Every command has a timeout: a Redis that stops answering is
UNAVAILABLE naming it within ``timeout_s``. Single Redis (or a Sentinel/replicated primary): the commit touches keys
of several hash slots, so Redis Cluster is not supported.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kiln.errors import DeadlineExceeded, Unavailable
from kiln.store import bundle
from kiln.store.artifact_store import FilesystemStore, Listing, StoredArtifact, held, is_key
from kiln.store.bundle import MAX_MANIFEST_BYTES, CorruptBundle, Manifest, UntrustedBundle
from kiln.store.redis_lease import MAX_LEASE_S, Lease
from kiln.store.signing import Signer, TrustedKeys

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
BATCH_BYTES = 4 << 20  # chunks per round trip: few round trips, memory bounded by a few batches
PENDING_S = 3600  # how long the chunks of an uncommitted upload live
SUPERSEDED_GRACE_S = 300  # how long a replaced generation's chunks stay for readers in the middle of them
DEFAULT_LEASE_S = 30.0
DEFAULT_TIMEOUT_S = 10.0  # the longest one command may take before the store is UNAVAILABLE
DEFAULT_MAX_BUNDLE_BYTES = 64 << 30  # what a reader downloads at most for one bundle
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_CHUNKS = 1 << 16  # per bundle: what a commit's or a removal's list of chunk keys may hold
MAX_SIGNATURE_BYTES = 4 << 10  # an Ed25519 signature file is ~150 bytes
MAX_LISTED = 100_000  # bundles ListArtifacts reads from the index
_GENERATION = re.compile(rb"[0-9a-f]{32}")
# KEYS: the bundle hash; ARGV: (field, most bytes) pairs. Each field's value, its length when over its bound (an
# integer: the value is never sent), nil when missing; the key's type when it is not a hash; nil when no key.
_READ_ENTRY = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return false end
if kind ~= 'hash' then return kind end
local out = {}
for i = 1, #ARGV, 2 do
  local size = redis.call('HSTRLEN', KEYS[1], ARGV[i])
  if size > tonumber(ARGV[i + 1]) then out[#out + 1] = size
  else out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i]) end
end
return out
"""
_ENTRY_FIELDS = {"manifest": MAX_MANIFEST_BYTES, "signature": MAX_SIGNATURE_BYTES, "generation": 32,
                 "chunk_bytes": 12}
_LISTED_FIELDS = {"manifest": MAX_MANIFEST_BYTES}


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
                 trusted: TrustedKeys | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES):
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes {chunk_bytes} is outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if not 0 < lease_s <= MAX_LEASE_S:
            raise ValueError(f"--lease-s {lease_s:g} is outside (0, {MAX_LEASE_S:g}]: a longer lease would be taken "
                             f"for a stale one")
        self.location = redacted(url)
        self.read_only = read_only
        self.signer = signer
        self.trusted = trusted
        self.lease_s = lease_s
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.max_bundle_bytes = max_bundle_bytes
        password = os.environ.get("KILN_STORE_PASSWORD") or None
        extra = {"password": password} if password else {}
        # Quick retries ride out a dropped connection; a Redis that stays down, or stops answering, is UNAVAILABLE
        # within timeout_s: a command that timed out is not retried (a frozen Redis would hold it for each retry).
        self.client = redis.Redis.from_url(
            url, socket_connect_timeout=min(2.0, timeout_s), socket_timeout=timeout_s, health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2, supported_errors=(redis.ConnectionError,)),
            **extra)
        self._read_entry = self.client.register_script(_READ_ENTRY)
        self.cache = FilesystemStore(cache_dir)
        self._thread_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._held: dict[str, Lease] = {}  # key -> this process's lease while it is held

    # --- single flight ---------------------------------------------------------------------------------------

    @contextmanager
    def lock(self, key: str, deadline: float | None = None) -> Iterator[None]:
        """Exclusive per key across every process on this Redis (a lease), and across threads of this one; waits
        until ``deadline`` at most (DEADLINE_EXCEEDED)."""
        with self._guard:
            thread_lock = self._thread_locks.setdefault(key, threading.Lock())
        with held(thread_lock, deadline, f"bundle {key[:12]} in the store {self.location}"):
            if self.read_only:
                yield
                return
            lease = Lease(self.client, f"kiln:lease:{key}", f"kiln:fence:{key}", self.lease_s)
            with self._reachable():
                if not lease.acquire(deadline):
                    raise DeadlineExceeded(f"bundle {key[:12]} in the store {self.location}: another compile "
                                           f"service held its lease until this call's deadline")
            self._held[key] = lease
            try:
                yield
            finally:
                del self._held[key]
                lease.release()

    # --- reading ---------------------------------------------------------------------------------------------

    def get(self, key: str, check: bool = True) -> Path | None:
        """The bundle as a verified local copy, or None when Redis has none. ``check=False`` leaves an up-to-date
        local copy unhashed, for a reader that hashes as it reads (GetArtifact). An entry that fails a check is
        DATA_LOSS (or FAILED_PRECONDITION for a signature) for a reader, and removed by a writer (None)."""
        self._check(key)
        with self._reachable():
            for _ in range(2):  # a second try when a newer commit replaced the chunks being read
                fields = self._fields(key, _ENTRY_FIELDS)
                if fields is None:
                    self.cache.delete(key)  # deleted from the store: not a hit anywhere any more
                    return None
                try:
                    entry = self._entry(key, fields)
                    local = self.cache.get(key, check)
                    if local is not None and (local / bundle.MANIFEST).read_bytes() == entry.manifest_bytes:
                        self.touch(key)
                        return local
                    path = self._download(key, entry)
                except _Superseded:
                    continue
                except (CorruptBundle, UntrustedBundle) as exc:
                    return self._corrupt(key, fields.get("generation"), exc)
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
        """Remove a bundle from Redis and the local copy; the bytes freed in Redis (0 when it was not there).
        An entry that does not read counts the bytes of the chunks removed."""
        self._check(key)
        if self.read_only:
            raise RuntimeError(f"delete of {key[:12]} through a read-only view of {self.location}")
        with self.lock(key), self._reachable():
            fields = self._fields(key, _ENTRY_FIELDS)
            self.cache.delete(key)
            if fields is None:
                return 0
            try:
                freed = self._entry(key, fields).manifest.total_bytes
            except CorruptBundle:
                freed = None
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(f"kiln:bundle:{key}")
            pipe.zrem("kiln:index", key)
            pipe.execute()
            removed = self._remove_chunks(key)
        return removed if freed is None else freed

    # --- internals -------------------------------------------------------------------------------------------

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        try:
            yield
        except redis.TimeoutError as exc:
            raise StoreUnavailable(f"store {self.location} did not answer within {self.timeout_s:g} s: "
                                   f"{exc}") from None
        except redis.ConnectionError as exc:
            raise StoreUnavailable(f"store {self.location} is unreachable: {exc}") from None
        except redis.ResponseError as exc:  # NOAUTH, WRONGPASS, READONLY replica, out of memory
            raise StoreUnavailable(f"store {self.location} refused the request: {exc}") from None

    @staticmethod
    def _check(key: str) -> None:
        if not is_key(key):
            raise ValueError(f"not an artifact key: {key!r}")

    def _fields(self, key: str, bounds: dict[str, int], client=None) -> "dict[str, bytes | int | None] | None":
        """The entry's fields, none over its bound (an int, its length, stands for one that is), or None when
        there is no entry; a key of another type reads as an entry whose manifest is missing."""
        argv = [x for name, most in bounds.items() for x in (name, most)]
        found = self._read_entry(keys=[f"kiln:bundle:{key}"], args=argv, client=client)
        if found is None:
            return None
        if isinstance(found, bytes):
            return {"type": found}
        return dict(zip(bounds, found, strict=True))

    def _entry(self, key: str, fields: dict) -> "_Entry":
        """The entry, every field checked: against its bound, the manifest's signature (with ``trusted``) and the
        configured maxima; CorruptBundle (or UntrustedBundle) naming what is wrong, before anything is read."""
        where = f"bundle {key} in the store {self.location}"
        if "type" in fields:
            raise CorruptBundle(f"{where}: a {fields['type'].decode(errors='replace')}, not a hash")
        for name, value in fields.items():
            if isinstance(value, int):
                raise CorruptBundle(f"{where}: its {name} is {value} bytes, more than the {_ENTRY_FIELDS[name]} it "
                                    f"may hold")
        manifest_bytes, signature = fields["manifest"], fields["signature"]
        if manifest_bytes is None:
            raise CorruptBundle(f"{where}: no manifest")
        generation, chunk_bytes = fields["generation"] or b"", fields["chunk_bytes"] or b""
        if not _GENERATION.fullmatch(generation):
            raise CorruptBundle(f"{where}: its generation {generation[:32]!r} is not 32 hex digits")
        if not (chunk_bytes.isdigit() and MIN_CHUNK_BYTES <= int(chunk_bytes) <= MAX_CHUNK_BYTES):
            raise CorruptBundle(f"{where}: its chunk_bytes {chunk_bytes[:12]!r} is not a number in "
                                f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] (written by a Kiln before chunk_bytes?)")
        try:
            text = manifest_bytes.decode()
        except UnicodeDecodeError:
            raise CorruptBundle(f"{where}: its manifest is not UTF-8") from None
        if self.trusted is not None:  # before anything else of the entry is believed
            if signature is None:
                raise UntrustedBundle(key, "none", "unsigned (no signature in the store)")
            try:
                signature_text = signature.decode()
            except UnicodeDecodeError:
                raise UntrustedBundle(key, "unreadable", "its signature is not UTF-8") from None
            manifest = bundle.check_signed(text, signature_text, key, self.trusted)[0]
        else:
            manifest = Manifest.from_json(text)
            if manifest.key != key:
                raise CorruptBundle(f"{where}: its manifest is of bundle {manifest.key[:12]}")
        entry = _Entry(manifest_bytes, signature, manifest, generation.decode(), int(chunk_bytes))
        if manifest.total_bytes > self.max_bundle_bytes:
            raise CorruptBundle(f"{where}: {manifest.total_bytes} bytes, more than the {self.max_bundle_bytes} this "
                                f"store reads")
        if entry.num_chunks > MAX_CHUNKS:
            raise CorruptBundle(f"{where}: {entry.num_chunks} chunks, more than the {MAX_CHUNKS} this store reads")
        return entry

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
        """Make the new generation the bundle, atomically, if no newer lease was granted since ours. The previous
        generation's chunks expire with it; those of one that does not read are found by a scan afterwards."""
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
                    old = self._fields(key, _ENTRY_FIELDS, client=pipe)
                    try:
                        superseded = self._entry(key, old).chunk_keys(key) if old else []
                    except (CorruptBundle, UntrustedBundle):
                        superseded = None
                    pipe.multi()
                    for chunk_key in new_chunks:
                        pipe.persist(chunk_key)
                    for chunk_key in superseded or []:
                        pipe.expire(chunk_key, SUPERSEDED_GRACE_S)
                    pipe.delete(bundle_key)
                    pipe.hset(bundle_key, mapping={
                        "manifest": manifest, "generation": generation, "chunk_bytes": self.chunk_bytes,
                        "chunks": json.dumps(chunks), "fence": lease.token, "committed_unix": time.time(),
                        **({"signature": signature} if signature is not None else {})})
                    pipe.zadd("kiln:index", {key: time.time()})
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        if superseded is None:
            self._remove_chunks(key, keep=generation)

    def _download(self, key: str, entry: "_Entry") -> Path:
        """Stream every file of ``entry`` to a local staging directory, checking sizes and sha256s as it goes; the
        signature was checked before (``_entry``), so no byte of an untrusted bundle reaches the disk."""
        staged = self.cache.staging_dir()
        try:
            for name, expected in entry.manifest.files.items():
                self._download_file(key, entry, name, expected, staged / name)
            (staged / bundle.MANIFEST).write_bytes(entry.manifest_bytes)
            if entry.signature is not None:
                (staged / bundle.SIGNATURE).write_bytes(entry.signature)
            return self.cache.commit(key, staged)
        except BaseException:
            self.cache.discard(staged)
            raise

    def _download_file(self, key: str, entry: "_Entry", name: str, expected: dict, dest: Path) -> None:
        """Each chunk read no longer than ``chunk_bytes`` (GETRANGE): a planted huge value costs one chunk."""
        digest, size, count = hashlib.sha256(), 0, entry.chunks_of(name)
        per_batch = max(1, BATCH_BYTES // entry.chunk_bytes)
        with open(dest, "wb") as f:
            for start in range(0, count, per_batch):
                pipe = self.client.pipeline(transaction=False)
                for i in range(start, min(count, start + per_batch)):
                    pipe.getrange(f"kiln:chunk:{key}:{entry.generation}:{name}:{i}", 0, entry.chunk_bytes)
                for chunk in pipe.execute():
                    if not chunk:  # chunks are never empty: a missing key
                        if self.client.hget(f"kiln:bundle:{key}", "generation") != entry.generation.encode():
                            raise _Superseded
                        raise CorruptBundle(f"bundle {key} in the store {self.location}: {name} has a missing chunk")
                    size += len(chunk)
                    if size > expected["size"] or len(chunk) > entry.chunk_bytes:
                        raise CorruptBundle(f"bundle {key} in the store {self.location}: {name} is larger than "
                                            f"its manifest's {expected['size']} bytes")
                    digest.update(chunk)
                    f.write(chunk)
        if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
            raise CorruptBundle(f"bundle {key} in the store {self.location}: {name} differs from its manifest's "
                                f"size and sha256")

    def _corrupt(self, key: str, generation: "bytes | int | None", exc: CorruptBundle | UntrustedBundle) -> None:
        """A reader refuses a bad entry; a writer removes it (if no commit replaced it meanwhile), so it is
        compiled again."""
        if self.read_only:
            raise exc
        log.warning("%s; removing it so that it is compiled again", exc)
        with contextlib.suppress(redis.WatchError), self.client.pipeline(transaction=True) as pipe:
            pipe.watch(f"kiln:bundle:{key}")
            now = self._fields(key, {"generation": 32}, client=pipe)
            if now is None or now.get("generation") != generation:
                return None
            pipe.multi()
            pipe.delete(f"kiln:bundle:{key}")
            pipe.zrem("kiln:index", key)
            pipe.execute()
        self._remove_chunks(key, only=generation if isinstance(generation, bytes) else None)
        return None

    def _remove_chunks(self, key: str, only: bytes | None = None, keep: str | None = None) -> int:
        """Delete the chunks of ``key`` (of one generation with ``only``, all but ``keep``'s otherwise), found by a
        scan rather than by what an entry says; returns their bytes. Memory: one batch of names."""
        generation = only.decode() if only is not None and _GENERATION.fullmatch(only) else None
        pattern = f"kiln:chunk:{key}:{generation}:*" if generation else f"kiln:chunk:{key}:*"
        skip = f"kiln:chunk:{key}:{keep}:".encode() if keep else None
        freed, batch = 0, []
        for name in self.client.scan_iter(match=pattern, count=1000):
            if skip is None or not name.startswith(skip):
                batch.append(name)
            if len(batch) >= 1000:
                freed += self._delete_counted(batch)
                batch = []
        return freed + (self._delete_counted(batch) if batch else 0)

    def _delete_counted(self, names: list[bytes]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        pipe.delete(*names)
        return sum(pipe.execute()[:-1])

    # Last: as a method name, ``list`` would shadow the builtin in the annotations of the methods after it.
    def list(self) -> Listing:
        """Every bundle of the index whose manifest reads, and each one that does not with why (it is that
        key's DATA_LOSS, never the listing's); at most MAX_LISTED, the most recently used first."""
        artifacts, unreadable = [], {}
        with self._reachable():
            scored = self.client.zrevrange("kiln:index", 0, MAX_LISTED - 1, withscores=True)
            for start in range(0, len(scored), 256):
                batch = scored[start:start + 256]
                pipe = self.client.pipeline(transaction=False)
                members = [member.decode(errors="replace") for member, _ in batch]
                for member in members:
                    self._read_entry(keys=[f"kiln:bundle:{member}"],
                                     args=["manifest", MAX_MANIFEST_BYTES], client=pipe)
                for member, (_, last_used), found in zip(members, batch, pipe.execute(), strict=True):
                    if found is None and is_key(member):
                        continue  # deleted between the two reads
                    try:
                        artifacts.append(StoredArtifact(self._listed(member, found), last_used))
                    except CorruptBundle as exc:
                        log.warning("%s", exc)
                        unreadable[member[:64]] = str(exc)
        return Listing(sorted(artifacts, key=lambda a: a.manifest.key), unreadable)

    def _listed(self, member: str, found: "bytes | list | None") -> Manifest:
        where = f"bundle {member[:64]!r} in the store {self.location}"
        if not is_key(member):
            raise CorruptBundle(f"{where}: not an artifact key")
        if isinstance(found, bytes):
            raise CorruptBundle(f"{where}: a {found.decode(errors='replace')}, not a hash")
        manifest = found[0]
        if not isinstance(manifest, bytes):
            raise CorruptBundle(f"{where}: its manifest is missing or more than {MAX_MANIFEST_BYTES} bytes")
        try:
            parsed = Manifest.from_json(manifest.decode())
        except UnicodeDecodeError:
            raise CorruptBundle(f"{where}: its manifest is not UTF-8") from None
        except CorruptBundle as exc:
            raise CorruptBundle(f"{where}: {exc}") from None
        if parsed.key != member:
            raise CorruptBundle(f"{where}: its manifest is of bundle {parsed.key[:12]}")
        return parsed


@dataclass(frozen=True)
class _Entry:
    """A bundle's entry once every field was checked: what a download reads, and nothing it does not."""

    manifest_bytes: bytes
    signature: bytes | None
    manifest: Manifest
    generation: str
    chunk_bytes: int

    def chunks_of(self, name: str) -> int:
        return -(-self.manifest.files[name]["size"] // self.chunk_bytes)

    @property
    def num_chunks(self) -> int:
        return sum(self.chunks_of(name) for name in self.manifest.files)

    def chunk_keys(self, key: str) -> list[str]:
        return [f"kiln:chunk:{key}:{self.generation}:{name}:{i}" for name in self.manifest.files
                for i in range(self.chunks_of(name))]


class _Superseded(Exception):
    """The generation being read was replaced by a newer commit: read the bundle again."""
