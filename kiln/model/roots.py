"""The directories under which a client may name a path: ``model.hf_dir`` (both services) and ``weights`` (exec).

The operator sets them with ``--model-root DIR`` (repeatable). A server bound off loopback with none reads no
client-named path at all; one bound to loopback with none reads any directory its user can (on one machine, the
client is a local user). A refusal reads the same whether or not the path exists. The server's Hugging Face cache
(kiln.model.hub), where Hub ids resolve, counts as one more root.

What is checked is what is read, with no window between: the directory is opened once (``O_NOFOLLOW``) and each file
Kiln may read in it (configs, tokenizers, safetensors) is opened once through that descriptor; where each opened
descriptor really lies is checked against the roots (the kernel's name for it, ``/proc/self/fd``). Everything later
reads those descriptors, through a private directory of links to them (``PinnedDir.view``) for the libraries that
take a directory: a path swapped for a symlink after the check is never followed, it was never opened.
"""

import contextlib
import errno
import fnmatch
import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path

from kiln.errors import FailedPrecondition, InvalidArgument, PermissionDenied, quote
from kiln.model.hub import HubCache

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX
# The files of a model directory Kiln reads: its config, tokenizer, chat template and weights.
PINNED_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
MAX_PINNED_FILES = 512  # a sharded 400B checkpoint has ~200 safetensors files


class ModelRoots:
    def __init__(self, roots: Iterable[str | Path] = (), any_path: bool = False, hub: HubCache | None = None):
        self.roots = [Path(os.path.realpath(Path(root).expanduser())) for root in roots]
        self.any_path = any_path and not self.roots
        self.hub = hub
        if hub is not None:
            self.roots.append(Path(os.path.realpath(Path(hub.cache_dir).expanduser())))

    @classmethod
    def for_server(cls, roots: Iterable[str | Path], loopback: bool, hub: HubCache | None = None) -> "ModelRoots":
        """The operator's roots; with none, any path on a loopback-only server and no path on any other. Hub ids
        resolve in ``hub``'s cache (refused without one)."""
        return cls(roots, any_path=loopback, hub=hub)

    def describe(self) -> str:
        hub = f"; Hub ids from the {self.hub.describe()}" if self.hub else "; no Hub ids"
        if self.any_path:
            return "any directory (loopback, no --model-root)" + hub
        operator = self.roots[:-1] if self.hub else self.roots
        return (", ".join(map(str, operator)) or "none (no --model-root: presets and inline configs only)") + hub

    def hub_dir(self, hub_id: str, field: str) -> "PinnedDir":
        """The snapshot directory of a Hub id in the server's Hugging Face cache, pinned as any directory is, every
        file in it inside the cache (whatever else this server may read)."""
        if self.hub is None:
            raise FailedPrecondition(f"{field}: this server resolves no Hub ids (it was started without a "
                                     f"Hugging Face cache, --hub-cache); name a directory or a preset")
        return ModelRoots([self.hub.cache_dir]).check_dir(str(self.hub.snapshot(hub_id, field)), field)

    def check_dir(self, path: str, field: str) -> "PinnedDir":
        """The directory at ``path`` and the files Kiln reads in it, each opened once it lies under a root;
        INVALID_ARGUMENT naming ``field`` for a path no filesystem could hold (empty, a NUL, a name or the whole too
        long) or a file that is not a regular one, PERMISSION_DENIED for anything outside the roots."""
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise InvalidArgument(f"{field}: not a usable path (empty, a NUL, or over {MAX_PATH_CHARS} characters)")
        pinned = None
        try:
            resolved = self._inside(os.path.realpath(path), path, field)
            try:
                fd = os.open(resolved, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError):
                return PinnedDir(resolved, None, {})  # the caller says what it missed there
            pinned = PinnedDir(resolved, fd, {})
            self._inside(_opened_path(fd), path, field)  # a component swapped between realpath and open
            names = sorted(n for n in os.listdir(fd) if any(fnmatch.fnmatch(n, p) for p in PINNED_PATTERNS))
            if len(names) > MAX_PINNED_FILES:
                raise InvalidArgument(f"{field}: {quote(path)} has {len(names)} config, tokenizer and weights "
                                      f"files, more than {MAX_PINNED_FILES}")
            for name in names:
                pinned.add(name, self._open_file(fd, name, path, field))
        except OSError as exc:
            if pinned is not None:
                pinned.close()
            reason = {errno.ENAMETOOLONG: "a name in it is too long",
                      errno.ELOOP: "it changed while it was checked (a link took its place)"}.get(exc.errno,
                                                                                                 exc.strerror)
            raise InvalidArgument(f"{field}: {quote(path)}: {reason}") from None
        except BaseException:
            if pinned is not None:
                pinned.close()
            raise
        return pinned

    def _open_file(self, dir_fd: int, name: str, named: str, field: str) -> int | None:
        """``name`` in the directory opened, if it is a regular file under a root (a link may point to one: a Hub
        cache's snapshots are links to its blobs); None for a subdirectory, which is not read."""
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            mode = os.fstat(fd).st_mode
            self._inside(_opened_path(fd), named, field)
            if stat.S_ISDIR(mode):
                os.close(fd)
                return None
            if not stat.S_ISREG(mode):
                raise InvalidArgument(f"{field}: {quote(name)} in {quote(named)} is not a regular file")
            os.set_blocking(fd, True)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _inside(self, resolved: str | Path, named: str, field: str) -> Path:
        resolved = Path(resolved)
        if self.any_path or any(resolved == root or root in resolved.parents for root in self.roots):
            return resolved
        raise PermissionDenied(f"{field}: {quote(named)} is not under a model root of this server (--model-root); "
                               f"it reads client-named directories there only")


class PinnedDir:
    """A checked directory and its files, held open: ``read`` and ``view`` reach exactly what was checked.

    ``path`` is where the directory was (for messages); ``view`` a private directory (mode 0700) of links, one per
    pinned file, to its open descriptor, for libraries that take a directory (transformers, safetensors). The
    descriptors and the view are released by ``close`` or when the object is collected.
    """

    def __init__(self, path: Path, fd: int | None, files: dict[str, int]):
        self.path = path
        self.is_dir = fd is not None
        self._files = files
        self._fds = [fd] if fd is not None else []
        self.view = Path(tempfile.mkdtemp(prefix="kiln-pinned-")) / path.name
        self.view.mkdir()
        self._release = weakref.finalize(self, _release, self._fds, self.view.parent)

    def add(self, name: str, fd: int | None) -> None:
        if fd is None:
            return
        self._fds.append(fd)
        self._files[name] = fd
        os.symlink(f"/proc/self/fd/{fd}", self.view / name)

    def names(self) -> list[str]:
        return sorted(self._files)

    @property
    def descriptors(self) -> tuple[int, ...]:
        """What a child process must inherit, at the same numbers, for ``view`` to reach the files there."""
        return tuple(self._fds)

    def read(self, name: str, max_bytes: int) -> bytes | None:
        """The pinned file's bytes (None when the directory had no such file), at most ``max_bytes`` + 1 of them:
        a caller that gets more refuses the file as too large."""
        fd = self._files.get(name)
        if fd is None:
            return None
        return os.pread(fd, max_bytes + 1, 0)

    def size(self, name: str) -> int:
        return os.fstat(self._files[name]).st_size

    def close(self) -> None:
        self._release()


def _opened_path(fd: int) -> str:
    """Where an open descriptor really lies, as the kernel names it now."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _release(fds: list[int], view: Path) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    shutil.rmtree(view, ignore_errors=True)
