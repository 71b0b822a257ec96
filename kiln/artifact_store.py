"""Where bundles live: the narrow store interface, and its filesystem backend (the embedded default).

The interface (ArtifactStore) is what the compile pipeline, the compile service's RPCs and the bundle fetcher use,
and nothing more. A bundle is a local directory once a caller holds it (a pickle is loaded from a file, and its
sha256s and signature are checked on that copy), so a remote backend keeps verified local copies:

- ``location``: where the store is, for messages and spans (a path, ``redis://host:port/db``); never a password.
- ``lock(key)``: single flight for one key across every process on the store (a file lock here, a fenced lease
  in Redis); ``commit`` of that key happens inside it.
- ``get(key) -> Path | None``: the committed bundle as a verified local directory, or None when there is none
  (a corrupt one is removed and reported missing by a writer, so it is rebuilt; a reader refuses it).
- ``staging_dir()`` / ``commit(key, staged)`` / ``discard(staged)``: build a bundle in a local directory, then
  publish it atomically (readers see the whole bundle or none of it), or throw it away.
- ``list()``: every committed bundle's manifest and last-used time (ListArtifacts); ``delete(key)``: bytes freed.

Writes are atomic; the compile service's store signs what it commits and, on a read, takes as present only a
bundle signed by a key it trusts: whoever else can write the store can plant bytes there but not a hit.

RedisStore (kiln/redis_store.py) is the second backend. An object store (S3 and the like) would be one more class
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
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kiln import bundle
from kiln.bundle import CorruptBundle, Manifest, UntrustedBundle
from kiln.errors import InvalidArgument, quote
from kiln.signing import Signer, TrustedKeys

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


class ArtifactStore(Protocol):
    """What the compile pipeline, the compile service and the bundle fetcher need of a store (see above)."""

    location: str

    def lock(self, key: str) -> AbstractContextManager[None]: ...
    def get(self, key: str) -> Path | None: ...
    def staging_dir(self) -> Path: ...
    def commit(self, key: str, staged: Path) -> Path: ...
    def discard(self, staged: Path) -> None: ...
    def list(self) -> list[StoredArtifact]: ...
    def delete(self, key: str) -> int: ...


class FilesystemStore:
    """Bundles as directories ``ROOT/<key>/``; staging under ``ROOT/.staging``, locks under ``ROOT/.locks``.

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
        if not self.read_only:
            (self.root / ".staging").mkdir(parents=True, exist_ok=True)
            (self.root / ".locks").mkdir(exist_ok=True)
        self._thread_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._verified: dict[str, tuple[float, int]] = {}  # key -> (manifest mtime, size) last verified here

    def path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not an artifact key: {key!r}")
        return self.root / key

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Exclusive per key, across threads of this process and across processes sharing the store."""
        with self._guard:
            thread_lock = self._thread_locks.setdefault(key, threading.Lock())
        if self.read_only:
            with thread_lock:
                yield
            return
        with thread_lock, open(self.root / ".locks" / f"{key}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def get(self, key: str) -> Path | None:
        """The verified bundle (unchecked with ``verify=False``), or None; a corrupt or untrusted bundle is deleted
        so the caller rebuilds it."""
        path = self.path(key)
        if not path.is_dir():
            return None
        stamp = self._stamp(path) if self.verify else None
        if self.verify and self._verified.get(key) != stamp:
            try:
                self._verify(key, path)
            except (CorruptBundle, UntrustedBundle) as exc:
                log.warning("store %s: bundle %s set aside: %s", self.root, key[:12], exc)
                if self.read_only:
                    return None
                self._remove(path)
                self._verified.pop(key, None)
                return None
            self._verified[key] = stamp
        self.touch(key)
        return path

    def _verify(self, key: str, path: Path) -> None:
        if self.trusted is None:
            bundle.verify(path)
        else:
            bundle.verify_signed(path, key, self.trusted)

    def touch(self, key: str) -> None:
        if not self.read_only:
            (self.path(key) / _LAST_USED).touch()

    def staging_dir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.root / ".staging"))

    def commit(self, key: str, staged: Path, verified: bool = False) -> Path:
        """Move a fully written staging directory into place (atomic rename on one filesystem). ``verified``: the
        caller checked every file against the manifest as it wrote it, so the next get need not hash it again."""
        target = self.path(key)
        if self.signer is not None:
            bundle.sign(staged, self.signer)
        if target.exists():
            self._remove(target)
        os.rename(staged, target)
        self.touch(key)
        if verified:
            self._verified[key] = self._stamp(target)
        else:
            self._verified.pop(key, None)
        return target

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def list(self) -> list[StoredArtifact]:
        out = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                manifest = bundle.read_manifest(path)
            except CorruptBundle:
                continue
            last_used = (path / _LAST_USED).stat().st_mtime if (path / _LAST_USED).exists() else manifest.created_unix
            out.append(StoredArtifact(manifest, last_used))
        return out

    def delete(self, key: str) -> int:
        """Remove a bundle; returns the bytes freed (0 when it was not there)."""
        path = self.path(key)
        if not path.is_dir():
            return 0
        freed = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        with self.lock(key):
            self._remove(path)
        self._verified.pop(key, None)
        return freed

    def _stamp(self, path: Path) -> tuple[float, int]:
        files = [p for p in path.iterdir() if p.name != _LAST_USED]
        return max(p.stat().st_mtime for p in files), sum(p.stat().st_size for p in files)

    def _remove(self, path: Path) -> None:
        """Rename away first so no reader ever sees a half-deleted bundle."""
        doomed = self.root / ".staging" / f"deleted-{path.name}-{time.monotonic_ns()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
