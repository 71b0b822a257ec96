"""Ed25519 signatures: the compile service's signing key, the execute service's trusted keys, key pairs on disk.

A bundle is a pickle, so what decides whether it may be unpickled is who signed its manifest, never where it was
found. The crypto is the ``cryptography`` package's; Kiln only names keys and reads and writes their files.
"""

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.json_object import bounded_loads

PRIVATE_KEY_FILE = "signing.key"
PUBLIC_KEY_FILE = "signing.pub"
ALGORITHM = "ed25519"
_PEM_PUBLIC_END = b"-----END PUBLIC KEY-----"


class KeyFileError(ValueError):
    """A key file the operator named is missing, unreadable or not an Ed25519 key; the message says which."""


class UntrustedSignature(Exception):
    """A signature that is missing, malformed, from a key not trusted here, or not over these bytes."""


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: what logs and errors call the signer."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{ALGORITHM}:{hashlib.sha256(raw).hexdigest()[:16]}"


def public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class Signature:
    signer: str  # key_id of the signing key
    value: bytes

    def to_json(self) -> str:
        return json.dumps({"algorithm": ALGORITHM, "signer": self.signer,
                           "signature": base64.b64encode(self.value).decode()}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Signature":
        try:
            fields = bounded_loads(text)
            if fields.get("algorithm") != ALGORITHM:
                raise UntrustedSignature(f"signature algorithm {fields.get('algorithm')!r} is not {ALGORITHM}")
            return cls(str(fields["signer"]), base64.b64decode(fields["signature"], validate=True))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UntrustedSignature(f"malformed signature file: {type(exc).__name__}") from None


class Signer:
    """The compile service's private key: signs each bundle's manifest as it commits it."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id(self.public_key)

    @classmethod
    def load(cls, path: str | Path) -> "Signer":
        path = Path(path).expanduser()
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except OSError as exc:
            raise KeyFileError(f"signing key {path}: {exc.strerror or exc}") from None
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"signing key {path}: not a PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"signing key {path}: a {type(key).__name__}, not an Ed25519 key (kiln keygen)")
        return cls(key)

    def sign(self, data: bytes) -> Signature:
        return Signature(self.key_id, self._private_key.sign(data))


class TrustedKeys:
    """The public keys whose signatures this process accepts; several at once, so a key can be rotated."""

    def __init__(self, public_keys: list[Ed25519PublicKey]):
        self.keys = {key_id(k): k for k in public_keys}

    @classmethod
    def load(cls, path: str | Path) -> "TrustedKeys":
        """A PEM file of one or more public keys, or a directory whose ``*.pub`` files are read."""
        path = Path(path).expanduser()
        if path.is_dir():
            files = sorted(path.glob("*.pub"))
            if not files:
                raise KeyFileError(f"trusted keys {path}: a directory without *.pub files")
        else:
            files = [path]
        keys = []
        for file in files:
            keys += _public_keys(file)
        return cls(keys)

    def with_key(self, public_key: Ed25519PublicKey) -> "TrustedKeys":
        return TrustedKeys([*self.keys.values(), public_key])

    def verify(self, data: bytes, signature: Signature) -> None:
        key = self.keys.get(signature.signer)
        if key is None:
            raise UntrustedSignature(f"signer {signature.signer} is not a trusted key here "
                                     f"(trusted: {', '.join(sorted(self.keys)) or 'none'})")
        try:
            key.verify(signature.value, data)
        except InvalidSignature:
            raise UntrustedSignature(f"signature by {signature.signer} does not match the manifest") from None


def _public_keys(file: Path) -> list[Ed25519PublicKey]:
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"trusted keys {file}: {exc.strerror or exc}") from None
    blocks = [block + _PEM_PUBLIC_END for block in data.split(_PEM_PUBLIC_END) if block.strip()]
    keys = []
    for block in blocks:
        try:
            key = serialization.load_pem_public_key(block.strip())
        except ValueError as exc:
            raise KeyFileError(f"trusted keys {file}: not a PEM public key ({exc})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFileError(f"trusted keys {file}: a {type(key).__name__}, not an Ed25519 key")
        keys.append(key)
    if not keys:
        raise KeyFileError(f"trusted keys {file}: no public key in it")
    return keys


def local_keys_dir(store: Path) -> Path:
    """Where local services (``kiln demo``, ``kiln bench``, the benches) keep the key pair of a store they made:
    beside it, so a kept store stays loadable from one run to the next."""
    return store.parent / f"{store.name}.keys"


def generate_key_pair(directory: str | Path, public_directory: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``signing.key`` (owner-only) into ``directory`` and ``signing.pub`` into ``public_directory`` (default:
    the same). An existing key is kept, never overwritten: returns the paths either way."""
    private_path = Path(directory).expanduser() / PRIVATE_KEY_FILE
    public_path = Path(public_directory or directory).expanduser() / PUBLIC_KEY_FILE
    private_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    if private_path.exists():
        signer = Signer.load(private_path)
    else:
        signer = Signer(Ed25519PrivateKey.generate())
        pem = signer._private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption())
        write_private(private_path, pem)
    if not public_path.exists():
        public_path.write_bytes(public_pem(signer.public_key))
    return private_path, public_path


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only, from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
