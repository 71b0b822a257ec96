"""Where bundles live: the narrow store interface, and its filesystem backend (the embedded default).

The interface (ArtifactStore) is what the compile pipeline, the compile service's RPCs and the bundle fetcher use,
and nothing more. A bundle is a local directory once a caller holds it (a pickle is loaded from a file, and its
sha256s and signature are checked on that copy), so a remote backend keeps verified local copies:

- ``location``: where the store is, for messages and spans (a path, ``redis://host:port/db``); never a password.
- ``lock(key, deadline=None)``: single flight for one key across every process on the store (a file lock here, a
  fenced lease in Redis); ``commit`` of that key happens inside it. A waiter gives up at ``deadline``
  (``time.monotonic()``), the deadline of the call it serves, with DEADLINE_EXCEEDED: no worker thread waits on
  behalf of a client that is gone.
- ``get(key, check=True) -> Path | None``: the committed bundle as a local directory checked now (never
  remembered as good: bit rot keeps the modification time), or None when there is none (a corrupt one is taken out
  of service by a writer, so it is rebuilt; a reader refuses it). ``check=False`` is for a reader that hashes as it
  reads (GetArtifact) and calls ``get`` again, under the lock, when that finds a difference.
- ``quarantine(key, reason)``: take a local copy that failed a check at load out of service, kept for a person.
- ``staging_dir()`` / ``commit(key, staged)`` / ``discard(staged)``: build a bundle in a local directory, then
  publish it atomically (readers see the whole bundle or none of it), or throw it away.
- ``list()``: every committed bundle's manifest and last-used time (ListArtifacts), and each entry that does not
  read, with why: one bad entry is that key's DATA_LOSS, never the whole listing's; ``delete(key)``: bytes freed.

Writes are atomic; the compile service's store signs what it commits and, on a read, takes as present only a
bundle signed by a key it trusts: whoever else can write the store can plant bytes there but not a hit. A process
killed mid-write leaves a staging directory and a lock file; the next process to open the store sweeps both.

RedisStore (kiln/store/redis_store.py) is the second backend. An object store (S3 and the like) would be one more class
of the same methods: files uploaded as objects under a fresh prefix ``<key>/<generation>/``, then a small
``<key>/current`` object naming that generation, manifest and signature written last with a conditional write
(If-Match on the previous version) as the commit point; ``lock`` a lease object created with If-None-Match and a
fencing number checked in that conditional write; ``list`` a listing of ``*/current``; ``get`` a download into the
same local copies RedisStore keeps.
"""

import fcntl
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kiln.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, quote
from kiln.store import bundle
from kiln.store.bundle import CorruptBundle, Manifest, UntrustedBundle
from kiln.store.signing import Signer, TrustedKeys

log = logging.getLogger(__name__)

_LAST_USED = ".last_used"


def is_key(key: str) -> bool:
    """An artifact key is the sha256 of its key factors: 64 lowercase hex characters."""
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)


def check_key(digest: str) -> None:
    """INVALID_ARGUMENT naming the request field, for a key a client sent."""
    if not is_key(digest):
        raise InvalidArgument(f"key.digest: {quote(digest)} is not a 64-character hex sha256")


@dataclass
class StoredArtifact:
    manifest: Manifest
    last_used_unix: float


@dataclass
class Listing:
    """What ``list`` found: the bundles that read, and key (or entry name) -> why, for those that do not."""

    artifacts: list[StoredArtifact]
    unreadable: dict[str, str]


class ArtifactStore(Protocol):
    """What the compile pipeline, the compile service and the bundle fetcher need of a store (see above)."""

    location: str

    def lock(self, key: str, deadline: float | None = None) -> AbstractContextManager[None]: ...
    def get(self, key: str, check: bool = True) -> Path | None: ...
    def quarantine(self, key: str, reason: str) -> None: ...
    def staging_dir(self) -> Path: ...
    def commit(self, key: str, staged: Path) -> Path: ...
    def discard(self, staged: Path) -> None: ...
    def list(self) -> Listing: ...
    def delete(self, key: str) -> int: ...


class FilesystemStore:
    """Bundles as directories ``ROOT/<key>/``; staging under ``ROOT/.staging``, locks under ``ROOT/.locks``,
    bundles that failed their check under ``ROOT/.quarantine`` (the latest one per key, for a person to look at).

    With a ``signer``, every commit is signed; with ``trusted`` keys, a bundle is present only when its signature
    verifies (the compile service's store). With ``verify=False`` (the execute service's) reads check nothing: the
    fetcher checks the signature and every sha256 itself, so a tampered bundle is reported as refused, naming its
    signer, rather than quietly dropped as missing.
    """

    def __init__(self, root: Path | str, signer: Signer | None = None, trusted: TrustedKeys | None = None,
                 verify: bool = True):
        self.root = Path(root).expanduser()
        self.location = str(self.root)
        self.signer = signer
        self.trusted = trusted
        self.verify = verify
        # A store mounted read-only (the exec service's view of a shared volume) is read, never written: bundles
        # appear there by atomic rename, so a reader needs no lock, and it leaves last-used times to the writer.
        self.read_only = self.root.is_dir() and not os.access(self.root, os.W_OK)
        self._thread_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._staging: dict[Path, int] = {}  # staging directory -> the descriptor whose flock marks it as live
        if not self.read_only:
            for sub in (".staging", ".locks", ".quarantine"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            self.sweep()

    def path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not an artifact key: {key!r}")
        return self.root / key

    @contextmanager
    def lock(self, key: str, deadline: float | None = None) -> Iterator[None]:
        """Exclusive per key, across threads of this process and across processes sharing the store; waits until
        ``deadline`` at most (DEADLINE_EXCEEDED).

        The lock file is removed on release, so none outlives its holder; a waiter that wakes on a removed file
        takes the lock again on the new one.
        """
        with self._guard:
            thread_lock = self._thread_locks.setdefault(key, threading.Lock())
        with held(thread_lock, deadline, f"bundle {key[:12]} in the store {self.root}"):
            if self.read_only:
                yield
                return
            path = self.root / ".locks" / f"{key}.lock"
            fd = _flock(path, blocking=True, deadline=deadline)
            try:
                yield
            finally:
                path.unlink(missing_ok=True)
                os.close(fd)

    def get(self, key: str, check: bool = True) -> Path | None:
        """The bundle, checked now (not with ``verify=False``), or None; one that fails is quarantined, so the
        caller rebuilds it. Call it holding the key's lock. ``check=False`` is for a reader that hashes as it reads
        (GetArtifact) and calls ``get`` again, under the lock, when that finds a difference."""
        path = self.path(key)
        if not os.path.lexists(path):
            return None
        if not _is_real_dir(path):
            exc = CorruptBundle(f"bundle {key} in the store {self.root}: not a directory (a link or a file was put "
                                f"in its place)")
            if self.verify and check and not self.read_only:
                self.quarantine(key, str(exc))
                return None
            raise exc
        if self.verify and check:
            try:
                self._verify(key, path)
            except (CorruptBundle, UntrustedBundle) as exc:
                self.quarantine(key, str(exc))
                return None
        self.touch(key)
        return path

    def _verify(self, key: str, path: Path) -> None:
        if self.trusted is not None:
            bundle.verify_signed(path, key, self.trusted)
        elif bundle.verify(path).key != key:
            raise CorruptBundle(f"its manifest is of bundle {bundle.read_manifest(path).key[:12]}")

    def quarantine(self, key: str, reason: str) -> None:
        """Take a bundle that failed its check out of service, keeping it aside for a person to look at."""
        if self.read_only:
            log.error("bundle %s in the read-only store %s fails its check (%s); its writer must rebuild it",
                      key[:12], self.root, reason)
            return
        kept = self.root / ".quarantine" / key
        try:
            if kept.exists():
                shutil.rmtree(kept)
            os.rename(self.path(key), kept)
        except FileNotFoundError:
            return  # another process took it out first
        log.error("bundle %s failed its check (%s): moved to %s; it is rebuilt on the next Compile", key[:12],
                  reason, kept)

    def touch(self, key: str) -> None:
        if not self.read_only:
            (self.path(key) / _LAST_USED).touch()

    def staging_dir(self) -> Path:
        """A new directory to write a bundle into, marked live (flock) until commit or discard."""
        if self.read_only:
            raise FailedPrecondition(f"store: {self.root} is read-only; a new bundle has nowhere to be written")
        while True:
            staged = Path(tempfile.mkdtemp(dir=self.root / ".staging"))
            fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:  # not swept by another process starting between mkdtemp and flock
                self._staging[staged] = fd
                return staged
            os.close(fd)

    def commit(self, key: str, staged: Path) -> Path:
        """Move a fully written staging directory into place (atomic rename on one filesystem)."""
        target = self.path(key)
        if self.signer is not None:
            bundle.sign(staged, self.signer)
        if target.exists():
            self._remove(target)
        os.rename(staged, target)
        self._release(staged)
        self.touch(key)
        return target

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)
        self._release(staged)

    def list(self) -> Listing:
        artifacts, unreadable = [], {}
        for path in sorted(self.root.iterdir()):
            if path.name.startswith("."):
                continue
            try:
                if not is_key(path.name) or not _is_real_dir(path):
                    raise CorruptBundle(f"{path.name[:64]!r} in the store {self.root} is not a bundle directory")
                manifest = bundle.read_manifest(path)
                if manifest.key != path.name:
                    raise CorruptBundle(f"bundle {path.name}: its manifest is of bundle {manifest.key[:12]}")
            except CorruptBundle as exc:
                log.warning("%s", exc)
                unreadable[path.name[:64]] = str(exc)
                continue
            last_used = (path / _LAST_USED).stat().st_mtime if (path / _LAST_USED).exists() else manifest.created_unix
            artifacts.append(StoredArtifact(manifest, last_used))
        return Listing(artifacts, unreadable)

    def delete(self, key: str) -> int:
        """Remove a bundle; returns the bytes freed (0 when it was not there)."""
        path = self.path(key)
        if not os.path.lexists(path):
            return 0
        with self.lock(key):
            if not _is_real_dir(path):  # a link or a file in a bundle's place: removed, never followed
                freed = os.lstat(path).st_size
                os.unlink(path)
                return freed
            freed = sum(p.lstat().st_size for p in path.iterdir() if p.is_file() and not p.is_symlink())
            self._remove(path)
        return freed

    def sweep(self) -> None:
        """Remove what killed processes left: staging directories and lock files nobody holds."""
        swept = 0
        for staged in (self.root / ".staging").iterdir():
            try:
                fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer's
            finally:
                os.close(fd)
            shutil.rmtree(staged, ignore_errors=True)
            swept += 1
        for lock_file in (self.root / ".locks").glob("*.lock"):
            try:
                fd = _flock(lock_file, blocking=False)
            except BlockingIOError:
                continue
            lock_file.unlink(missing_ok=True)
            os.close(fd)
            swept += 1
        if swept:
            log.info("store %s: swept %d leftovers of interrupted writes", self.root, swept)

    def _release(self, staged: Path) -> None:
        fd = self._staging.pop(staged, None)
        if fd is not None:
            os.close(fd)

    def _remove(self, path: Path) -> None:
        """Rename away first so no reader ever sees a half-deleted bundle."""
        doomed = self.root / ".staging" / f"deleted-{path.name}-{time.monotonic_ns()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _is_real_dir(path: Path) -> bool:
    """A directory itself, not a link to one."""
    return stat.S_ISDIR(os.lstat(path).st_mode)


@contextmanager
def held(lock: threading.Lock, deadline: float | None, what: str) -> Iterator[None]:
    """``lock`` held, waited for until ``deadline`` at most."""
    if not lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
        raise DeadlineExceeded(f"{what}: another request held its lock until this call's deadline")
    try:
        yield
    finally:
        lock.release()


_POLL_S = 0.05  # how often a waiter with a deadline tries a lock another process holds


def _flock(path: Path, blocking: bool, deadline: float | None = None) -> int:
    """An open descriptor holding the exclusive flock of the file now at ``path`` (created if missing); blocking
    waits until ``deadline`` at most (DEADLINE_EXCEEDED).

    Holders remove the file when they release it, so a lock taken on a file that is no longer at ``path`` is
    worthless: take it again on the one that is.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if blocking and deadline is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                _flock_until(fd, deadline if blocking else None, path)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _flock_until(fd: int, deadline: float | None, path: Path) -> None:
    """LOCK_NB once (``deadline`` None), or again every _POLL_S until ``deadline``."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if deadline is None:
                raise
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"bundle {path.stem[:12]} in the store {path.parent.parent}: another "
                                       f"process held its lock until this call's deadline") from None
            time.sleep(_POLL_S)
