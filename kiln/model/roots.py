"""The directories under which a client may name a path: ``model.hf_dir`` (both services) and ``weights`` (exec).

The operator sets them with ``--model-root DIR`` (repeatable). A server bound off loopback with none reads no
client-named path at all; one bound to loopback with none reads any directory its user can (on one machine, the
client is a local user). Paths are compared after every symlink is resolved, the directory's own entries too, and
a refusal reads the same whether or not the path exists. The server's Hugging Face cache (kiln.model.hub), where
Hub ids resolve, counts as one more root.
"""

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from kiln.errors import FailedPrecondition, InvalidArgument, PermissionDenied, quote
from kiln.model.hub import HubCache

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


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

    def hub_dir(self, hub_id: str, field: str) -> Path:
        """The snapshot directory of a Hub id in the server's Hugging Face cache, every entry resolving inside the
        cache (whatever else this server may read)."""
        if self.hub is None:
            raise FailedPrecondition(f"{field}: this server resolves no Hub ids (it was started without a "
                                     f"Hugging Face cache, --hub-cache); name a directory or a preset")
        return ModelRoots([self.hub.cache_dir]).check_dir(str(self.hub.snapshot(hub_id, field)), field)

    def check_dir(self, path: str, field: str) -> Path:
        """``path`` with its symlinks resolved, once it and every entry in it lie under a root; INVALID_ARGUMENT
        naming ``field`` for a path no filesystem could hold (empty, a NUL, a name or the whole too long)."""
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise InvalidArgument(f"{field}: not a usable path (empty, a NUL, or over {MAX_PATH_CHARS} characters)")
        try:
            resolved = self._inside(path, path, field)
            if resolved.is_dir():
                for entry in resolved.iterdir():
                    self._inside(entry, path, field)
        except OSError as exc:
            reason = "a name in it is too long" if exc.errno == errno.ENAMETOOLONG else exc.strerror
            raise InvalidArgument(f"{field}: {quote(path)}: {reason}") from None
        return resolved

    def _inside(self, candidate: str | Path, named: str, field: str) -> Path:
        resolved = Path(os.path.realpath(candidate))
        if self.any_path or any(resolved == root or root in resolved.parents for root in self.roots):
            return resolved
        raise PermissionDenied(f"{field}: {quote(named)} is not under a model root of this server (--model-root); "
                               f"it reads client-named directories there only")
