"""``--store``: a directory (the filesystem store) or ``redis://HOST:PORT/DB`` / ``rediss://`` (the Redis store)."""

from pathlib import Path

from kiln.store.artifact_store import ArtifactStore, FilesystemStore
from kiln.store.signing import Signer, TrustedKeys

REDIS_SCHEMES = ("redis://", "rediss://")


def is_remote(location: str) -> bool:
    return location.startswith(REDIS_SCHEMES)


def open_store(location: str | Path, cache_dir: str | Path, *, read_only: bool = False,
               lease_s: float | None = None, signer: Signer | None = None, trusted: TrustedKeys | None = None,
               verify: bool = True) -> ArtifactStore:
    """The store at ``location``. A remote one keeps its verified local copies under ``cache_dir``; ``read_only``
    (an execute replica) never writes it; ``lease_s`` is how long a compile service's lease outlives its holder.
    ``signer`` signs every commit, ``trusted`` keys decide what counts as present, and ``verify=False`` leaves every
    check to the caller (the execute service's fetcher, which reports a refused bundle as refused)."""
    text = str(location)
    if is_remote(text):
        from kiln.store.redis_store import DEFAULT_LEASE_S, RedisStore

        return RedisStore(text, cache_dir, read_only=read_only, lease_s=lease_s or DEFAULT_LEASE_S, signer=signer,
                          trusted=trusted)
    if "://" in text:
        raise ValueError(f"--store: {text.split('://')[0]}:// is not a store Kiln knows; give a directory, "
                         f"redis://HOST:PORT/DB or rediss://HOST:PORT/DB")
    return FilesystemStore(text, signer, trusted, verify)
