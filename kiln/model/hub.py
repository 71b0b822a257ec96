"""Hugging Face Hub ids (``org/name``, optionally ``@revision``) as snapshot directories of the local HF cache.

The cache is read first and, by default, only: a client names a repository, and a server that downloaded whatever
it was named would fetch arbitrary repositories for anyone who can call it. Downloading is the operator's choice
(``--allow-hub-downloads``), and even then only configs, safetensors and tokenizer files come down: no code, no
pickled weights. Nothing is ever loaded with ``trust_remote_code``.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, quote

# Hub names: letters, digits, '-', '_', '.', never starting with '.' (so no '..'); a revision is a branch, a tag
# or a commit hash.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                    r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9_.-]{0,127}))?")
# What a download may fetch: a model's config, safetensors, and its tokenizer and chat template.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]


def is_hub_id(text: str) -> bool:
    return HUB_ID.fullmatch(text) is not None


@dataclass(frozen=True)
class HubCache:
    """The Hugging Face cache a server reads Hub ids from (``--hub-cache``), and whether it may download."""

    cache_dir: Path
    allow_downloads: bool = False

    def describe(self) -> str:
        downloads = "downloads allowed" if self.allow_downloads else "no downloads"
        return f"Hugging Face cache {self.cache_dir} ({downloads})"

    def snapshot(self, hub_id: str, field: str) -> Path:
        """The snapshot directory of ``hub_id``: from the cache, else downloaded where allowed; statuses name
        ``field``."""
        match = HUB_ID.fullmatch(hub_id)
        if match is None:
            raise InvalidArgument(f"{field}: {quote(hub_id)} is not a Hub id (org/name or org/name@revision)")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo, revision = match["repo"], match["revision"]
        try:
            try:
                return Path(snapshot_download(repo, revision=revision, cache_dir=self.cache_dir,
                                              local_files_only=True))
            except LocalEntryNotFoundError:
                if not self.allow_downloads:
                    raise NotFound(f"{field}: {quote(hub_id)} is not in this server's Hugging Face cache "
                                   f"({self.cache_dir}) and it downloads nothing; the operator can fetch it there "
                                   f"(hf download) or start the server with --allow-hub-downloads") from None
            return Path(snapshot_download(repo, revision=revision, cache_dir=self.cache_dir,
                                          allow_patterns=DOWNLOAD_PATTERNS))
        except HFValidationError as exc:
            raise InvalidArgument(f"{field}: {quote(hub_id)}: {exc}") from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise NotFound(f"{field}: no repository or revision {quote(hub_id)} on the Hub (or it is gated and the "
                           f"server's token may not read it)") from None
        except LocalEntryNotFoundError:  # downloads allowed, but HF_HUB_OFFLINE is set
            raise FailedPrecondition(f"{field}: {quote(hub_id)} is not in the Hugging Face cache and HF_HUB_OFFLINE "
                                     f"forbids downloading it") from None
        except (HfHubHTTPError, OSError) as exc:
            raise Unavailable(f"{field}: downloading {quote(hub_id)} failed: {exc}; retry later") from None
