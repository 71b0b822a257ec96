"""The artifact bundle: a directory with the compiled function, its key factors, a manifest of sha256s and the
compile service's signature over that manifest.

The compiled function is a pickle: it is unpickled only from bytes whose sha256 a trusted key signed (through the
manifest), read once into memory so that what was checked is what is loaded. A bundle travels as an uncompressed
tar stream whose own sha256 is sent ahead of it.
"""

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import DataLoss, FailedPrecondition
from kiln.signing import Signature, Signer, TrustedKeys, UntrustedSignature

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
KEY_FACTORS = "key_factors.json"
COMPILED_FN = "compiled_fn.bin"
# Not covered by the manifest: the manifest itself, its signature, and the store's last-used stamp.
_UNLISTED = {MANIFEST, SIGNATURE, ".last_used"}


class CorruptBundle(DataLoss):
    """A bundle on disk or on the wire does not match its recorded sha256 or size."""


class UntrustedBundle(FailedPrecondition):
    """A bundle that is unsigned, signed by a key not trusted here, or not what its signed manifest says."""

    def __init__(self, key: str, signer: str, reason: str):
        super().__init__(f"bundle {key}: {reason} (signer: {signer}); refused, nothing of it was loaded")
        self.signer = signer


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Manifest:
    key: str
    model: str
    config_summary: str
    num_pieces: int
    num_splits: int
    timings: dict[str, float]
    created_unix: float
    files: dict[str, dict]  # name -> {"sha256": ..., "size": ...}

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        return cls(**json.loads(text))


def write_manifest(bundle_dir: Path, **fields) -> Manifest:
    """Hash every file in ``bundle_dir`` and write the manifest beside them."""
    files = {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(bundle_dir.iterdir())
        if p.name not in _UNLISTED
    }
    manifest = Manifest(files=files, **fields)
    (bundle_dir / MANIFEST).write_text(manifest.to_json())
    return manifest


def read_manifest(bundle_dir: Path) -> Manifest:
    try:
        return Manifest.from_json((bundle_dir / MANIFEST).read_text())
    except (OSError, ValueError, TypeError) as exc:
        raise CorruptBundle(f"unreadable manifest in {bundle_dir}: {exc}") from None


def verify(bundle_dir: Path) -> Manifest:
    """Check every file against the manifest; raise CorruptBundle on the first difference."""
    manifest = read_manifest(bundle_dir)
    for name, entry in manifest.files.items():
        path = bundle_dir / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            raise CorruptBundle(f"{name}: missing or wrong size")
        if sha256_file(path) != entry["sha256"]:
            raise CorruptBundle(f"{name}: sha256 differs from the manifest")
    return manifest


def sign(bundle_dir: Path, signer: Signer) -> None:
    """Sign the manifest's exact bytes: its key, and through each file's sha256 and size, the key factors and the
    compiled function."""
    manifest = (bundle_dir / MANIFEST).read_bytes()
    (bundle_dir / SIGNATURE).write_text(signer.sign(manifest).to_json())


def verify_signed(bundle_dir: Path, key: str, trusted: TrustedKeys) -> Manifest:
    """The manifest, once its signature verifies against a trusted key, it names ``key``, and every file it lists
    matches; UntrustedBundle (FAILED_PRECONDITION, naming the key and the signer) otherwise."""
    manifest, signer = _signed_manifest(bundle_dir, key, trusted)
    for name, entry in manifest.files.items():  # hashed in blocks: memory stays flat whatever a file's size
        path = bundle_dir / name
        if not path.is_file():
            raise UntrustedBundle(key, signer, f"{name} is missing")
        if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
            raise UntrustedBundle(key, signer, f"{name} differs from its signed sha256")
    return manifest


def _signed_manifest(bundle_dir: Path, key: str, trusted: TrustedKeys) -> tuple[Manifest, str]:
    """The manifest parsed from the very bytes whose signature verified, and the signer's key id."""
    try:
        signature = Signature.from_json((bundle_dir / SIGNATURE).read_text())
    except OSError:
        raise UntrustedBundle(key, "none", f"unsigned (no {SIGNATURE})") from None
    except UntrustedSignature as exc:
        raise UntrustedBundle(key, "unreadable", str(exc)) from None
    try:
        data = (bundle_dir / MANIFEST).read_bytes()
        trusted.verify(data, signature)
        manifest = Manifest.from_json(data.decode())
    except OSError:
        raise UntrustedBundle(key, signature.signer, f"no readable {MANIFEST}") from None
    except UntrustedSignature as exc:
        raise UntrustedBundle(key, signature.signer, str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise UntrustedBundle(key, signature.signer, f"its signed manifest does not parse: {exc}") from None
    if manifest.key != key:
        raise UntrustedBundle(key, signature.signer, f"its signed manifest is for another key, {manifest.key}")
    if COMPILED_FN not in manifest.files or KEY_FACTORS not in manifest.files:
        raise UntrustedBundle(key, signature.signer, "its signed manifest lists no compiled function")
    return manifest, signature.signer


def _read_listed(bundle_dir: Path, name: str, manifest: Manifest, signer: str) -> bytes:
    """A file's bytes, read once, after checking them against the signed manifest's size and sha256."""
    entry = manifest.files[name]
    try:
        data = (bundle_dir / name).read_bytes()
    except OSError:
        raise UntrustedBundle(manifest.key, signer, f"{name} is missing") from None
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise UntrustedBundle(manifest.key, signer, f"{name} differs from its signed sha256")
    return data


def pack(bundle_dir: Path) -> bytes:
    """The bundle as one tar stream, members in a fixed order so equal bundles give equal bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(bundle_dir.iterdir()):
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def unpack(data: bytes, expected_sha256: str, dest: Path) -> None:
    """Verify a received tar stream and extract it into ``dest`` (which must not exist)."""
    if hashlib.sha256(data).hexdigest() != expected_sha256:
        raise CorruptBundle("received bundle's sha256 differs from the one announced")
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(dest, filter="data")


def preload_runtime() -> None:
    """Import what loading a bundle needs (Dynamo's AOT loader, Inductor's runtime, Triton) once per process.

    A server calls this before it reports healthy, so a LoadModel's load phase is the bundle's own work and not
    seconds of first-time imports.
    """
    import importlib

    import kiln.attention  # noqa: F401
    for module in ("torch._dynamo.aot_compile", "torch._inductor.standalone_compile", "torch._inductor.codecache",
                   "torch._inductor.output_code", "torch._functorch._aot_autograd.aot_autograd_result",
                   # What each piece's Inductor output code imports at its top: ~2 s on first import (the
                   # scheduler, the codegen wrapper, the partitioners), paid here rather than in LoadModel.
                   "torch._inductor.codegen.memory_planning", "torch._inductor.select_algorithm"):
        importlib.import_module(module)
    try:
        importlib.import_module("torch._inductor.runtime.triton_heuristics")
    except ImportError:  # no Triton (CPU-only installs)
        pass


def load_compiled(bundle_dir: Path, key: str, trusted: TrustedKeys):
    """The compiled function of a bundle, called as ``fn(token_model, input_ids, positions)``; never compiles.

    Unpickles only bytes read once into memory and checked against the manifest a trusted key signed, so a file
    swapped after an earlier check is never what runs. torch checks Python, torch, CUDA, Triton and GPU itself and
    raises RuntimeError on a mismatch; callers check the key factors first so that a user sees which factor differs.
    """
    import torch

    import kiln.attention  # noqa: F401  (registers kiln::attention, which the split graph calls between pieces)

    manifest, signer = _signed_manifest(bundle_dir, key, trusted)
    data = _read_listed(bundle_dir, COMPILED_FN, manifest, signer)
    return torch.compiler.load_compiled_function(io.BytesIO(data))
