"""The artifact bundle: a directory with the compiled code of each kind of decoder layer, which kind each layer is,
the key factors, a manifest of sha256s and the compile service's signature over that manifest.

Each compiled layer is a pickle: it is unpickled only from bytes whose sha256 a trusted key signed (through the
manifest), read once into memory so that what was checked is what is loaded. Every time a bundle's bytes are served
or loaded they are hashed as they are read and checked against the manifest: a file that differs is DATA_LOSS (bit
rot or tampering), a manifest whose signature does not verify FAILED_PRECONDITION. On the wire a bundle is its
manifest and signature followed by its files' bytes, concatenated in the manifest's (sorted) order, in bounded
chunks: neither side holds more than a chunk of it in memory.
"""

import errno
import hashlib
import io
import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import DataLoss, FailedPrecondition
from kiln.json_object import bounded_loads
from kiln.store.signing import Signature, Signer, TrustedKeys, UntrustedSignature

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
KEY_FACTORS = "key_factors.json"
LAYER_KINDS = "layer_kinds.json"  # the kind of each decoder layer: which compiled code it runs
# Not covered by the manifest: the manifest itself, its signature, and the store's last-used stamp.
_UNLISTED = {MANIFEST, SIGNATURE, ".last_used"}
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a few files; anything larger is not one
MAX_FILES = 1024  # a bundle holds a compiled layer per kind of decoder layer and a few JSON files
MAX_FILE_BYTES = 1 << 40  # no compiled layer comes near; a reader's own bound (max_bundle_bytes) is lower
_READ_BYTES = 1 << 20


def compiled_layer_file(kind: int) -> str:
    """The file holding the aot-compiled code of one kind of decoder layer (``kiln.model.layer_regions``)."""
    return f"compiled_layer{kind}.bin"


class CorruptBundle(DataLoss):
    """A bundle on disk or on the wire whose bytes differ from its manifest: DATA_LOSS."""


class UntrustedBundle(FailedPrecondition):
    """A bundle that is unsigned, signed by a key not trusted here, or not what its signed manifest says."""

    def __init__(self, key: str, signer: str, reason: str):
        super().__init__(f"bundle {key}: {reason} (signer: {signer}); refused, nothing of it was loaded")
        self.signer = signer


def open_regular(path: Path, text: bool = False):
    """``path`` opened for reading, only when it is a regular file and not a link: a FIFO or a device put in a
    store would block a read forever, a link would read outside it. Anything else is CorruptBundle (DATA_LOSS)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptBundle(f"{path.name} is a symbolic link, not a file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptBundle(f"{path.name} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r", encoding="utf-8", newline="") if text else os.fdopen(fd, "rb")


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
        """Parse and check the shape of a manifest (it comes from a store or a peer: untrusted storage)."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise CorruptBundle(f"manifest: {len(text)} bytes, more than {MAX_MANIFEST_BYTES}")
        try:
            manifest = cls(**bounded_loads(text))
        except (ValueError, TypeError) as exc:
            raise CorruptBundle(f"manifest: unreadable: {exc}") from None
        if not isinstance(manifest.files, dict):
            raise CorruptBundle("manifest: files is not an object")
        if len(manifest.files) > MAX_FILES:
            raise CorruptBundle(f"manifest: {len(manifest.files)} files, more than {MAX_FILES}")
        for name, entry in manifest.files.items():
            if name != Path(name).name or name.startswith(".") or name in _UNLISTED or len(name) > 255:
                raise CorruptBundle(f"manifest: {name!r} is not a plain file name")
            if not (isinstance(entry, dict) and type(entry.get("size")) is int and 0 <= entry["size"] <= MAX_FILE_BYTES
                    and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64):
                raise CorruptBundle(f"manifest: {name!r} has no valid size and sha256")
        return manifest


def write_manifest(bundle_dir: Path, **fields) -> Manifest:
    """Hash every file in ``bundle_dir`` (not the store's own dot files) and write the manifest beside them."""
    files = {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(bundle_dir.iterdir())
        if p.name not in _UNLISTED and not p.name.startswith(".")
    }
    manifest = Manifest(files=files, **fields)
    (bundle_dir / MANIFEST).write_text(manifest.to_json())
    return manifest


def read_manifest(bundle_dir: Path) -> Manifest:
    return Manifest.from_json(_read_text(bundle_dir / MANIFEST))


def _read_text(path: Path) -> str:
    """A manifest or signature file as stored, bounded in size."""
    try:
        with open_regular(path, text=True) as f:  # the bytes signed, not a translation of them
            return f.read(MAX_MANIFEST_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise CorruptBundle(f"{path.parent.name}: unreadable {path.name}: {exc}") from None


def verify(bundle_dir: Path) -> Manifest:
    """Check every file against the manifest; raise CorruptBundle on the first difference."""
    manifest = read_manifest(bundle_dir)
    for _ in read_chunks(bundle_dir, manifest, _READ_BYTES):
        pass
    return manifest


def read_chunks(bundle_dir: Path, manifest: Manifest, chunk_bytes: int) -> Iterator[bytes]:
    """The bundle's files concatenated in the manifest's order, in chunks of ``chunk_bytes`` (the last shorter).

    Each file is hashed as it is read; the chunk that completes a file leaves only once the file matched its
    manifest entry, else CorruptBundle. Memory: two chunks, whatever the bundle's size.
    """
    pending = bytearray()
    for name in sorted(manifest.files):
        entry = manifest.files[name]
        digest, left = hashlib.sha256(), entry["size"]
        try:
            with open_regular(bundle_dir / name) as f:
                while left:
                    block = f.read(min(chunk_bytes, left))
                    if not block:
                        raise CorruptBundle(f"{name} is shorter than the {entry['size']} bytes its manifest lists")
                    digest.update(block)
                    left -= len(block)
                    if not left and (f.read(1) or digest.hexdigest() != entry["sha256"]):
                        raise CorruptBundle(f"{name} differs from the sha256 its manifest lists")
                    pending += block
                    while len(pending) >= chunk_bytes:
                        yield bytes(pending[:chunk_bytes])
                        del pending[:chunk_bytes]
        except FileNotFoundError:
            raise CorruptBundle(f"{name} is missing") from None
    if pending:
        yield bytes(pending)


def write_chunks(manifest_json: str, signature_json: str, chunks: Iterable[bytes], dest: Path) -> Manifest:
    """Write a bundle that arrives as ``read_chunks`` sent it into the empty directory ``dest``, checking each file
    against ``manifest_json`` as it is written (CorruptBundle at the first difference), then the manifest and its
    signature as they came. Memory: one chunk."""
    manifest = Manifest.from_json(manifest_json)
    incoming = iter(chunks)
    buffer = memoryview(b"")
    for name in sorted(manifest.files):
        entry = manifest.files[name]
        digest, left = hashlib.sha256(), entry["size"]
        with open(dest / name, "xb") as f:
            while left:
                if not buffer:
                    buffer = memoryview(next(incoming, b""))
                    if not buffer:
                        raise CorruptBundle(f"{name}: the stream ended {left} bytes before the file did")
                piece = buffer[:left]
                f.write(piece)
                digest.update(piece)
                left -= len(piece)
                buffer = buffer[len(piece):]
        if digest.hexdigest() != entry["sha256"]:
            raise CorruptBundle(f"{name}: the bytes received differ from the manifest's sha256")
    if buffer or any(incoming):
        raise CorruptBundle("the stream carries more bytes than the manifest lists")
    (dest / MANIFEST).write_text(manifest_json, newline="")
    if signature_json:
        (dest / SIGNATURE).write_text(signature_json, newline="")
    return manifest


def sign(bundle_dir: Path, signer: Signer) -> None:
    """Sign the manifest's exact bytes: its key, and through each file's sha256 and size, the key factors and the
    compiled function."""
    manifest = (bundle_dir / MANIFEST).read_bytes()
    (bundle_dir / SIGNATURE).write_text(signer.sign(manifest).to_json())


class AlteredBundle(CorruptBundle):
    """A file that differs from the sha256 its trusted, signed manifest lists: DATA_LOSS, naming key and signer."""

    def __init__(self, key: str, signer: str, reason: str):
        super().__init__(f"bundle {key}: {reason} (signer: {signer}); refused, nothing of it was loaded")


def verify_signed(bundle_dir: Path, key: str, trusted: TrustedKeys) -> Manifest:
    """The manifest, once its signature verifies against a trusted key and it names ``key`` (UntrustedBundle,
    FAILED_PRECONDITION, otherwise), and every file it lists matches (AlteredBundle, DATA_LOSS, otherwise); both
    name the key and the signer."""
    manifest_json, signature_json = _read_text(bundle_dir / MANIFEST), _read_signature(bundle_dir, key)
    manifest, signer = check_signed(manifest_json, signature_json, key, trusted)
    try:
        for _ in read_chunks(bundle_dir, manifest, _READ_BYTES):
            pass
    except CorruptBundle as exc:
        raise AlteredBundle(key, signer, str(exc)) from None
    return manifest


def read_signed(bundle_dir: Path, key: str, trusted: TrustedKeys) -> tuple[str, str, Manifest]:
    """The manifest and signature as stored, and the manifest once the signature verifies: what GetArtifact sends
    ahead of the files it then hashes as it streams them."""
    manifest_json, signature_json = _read_text(bundle_dir / MANIFEST), _read_signature(bundle_dir, key)
    return manifest_json, signature_json, check_signed(manifest_json, signature_json, key, trusted)[0]


def _read_signature(bundle_dir: Path, key: str) -> str:
    if not (bundle_dir / SIGNATURE).is_file():
        raise UntrustedBundle(key, "none", f"unsigned (no {SIGNATURE})")
    return _read_text(bundle_dir / SIGNATURE)


def check_signed(manifest_json: str, signature_json: str, key: str, trusted: TrustedKeys) -> tuple[Manifest, str]:
    """The manifest parsed from the very text whose signature verified, and the signer's key id."""
    try:
        signature = Signature.from_json(signature_json)
    except UntrustedSignature as exc:
        raise UntrustedBundle(key, "unreadable", str(exc)) from None
    try:
        trusted.verify(manifest_json.encode(), signature)
        manifest = Manifest.from_json(manifest_json)
    except UntrustedSignature as exc:
        raise UntrustedBundle(key, signature.signer, str(exc)) from None
    except CorruptBundle as exc:
        raise UntrustedBundle(key, signature.signer, f"its signed manifest does not parse: {exc}") from None
    if manifest.key != key:
        raise UntrustedBundle(key, signature.signer, f"its signed manifest is for another key, {manifest.key}")
    if compiled_layer_file(0) not in manifest.files or KEY_FACTORS not in manifest.files:
        raise UntrustedBundle(key, signature.signer, "its signed manifest lists no compiled layer")
    return manifest, signature.signer


def _read_listed(bundle_dir: Path, name: str, manifest: Manifest, signer: str) -> bytes:
    """A file's bytes, read once, after checking them against the signed manifest's size and sha256."""
    entry = manifest.files[name]
    try:
        with open_regular(bundle_dir / name) as f:
            data = f.read(entry["size"] + 1)
    except OSError:
        raise AlteredBundle(manifest.key, signer, f"{name} is missing") from None
    except CorruptBundle as exc:
        raise AlteredBundle(manifest.key, signer, str(exc)) from None
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise AlteredBundle(manifest.key, signer, f"{name} differs from the sha256 its manifest lists")
    return data


def preload_runtime() -> None:
    """Import what loading a bundle needs (Dynamo's AOT loader, Inductor's runtime, Triton) once per process.

    A server calls this before it reports healthy, so a LoadModel's load phase is the bundle's own work and not
    seconds of first-time imports.
    """
    import importlib

    import kiln.attention.op  # noqa: F401
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
    """The bundle's compiled layers, called as ``fn(token_model, input_ids, positions)``; never compiles.

    Unpickles only bytes read once into memory and checked against the manifest a trusted key signed, so a file
    swapped after an earlier check is never what runs; every layer's bytes are checked before any is unpickled.
    torch checks Python, torch, CUDA, Triton and GPU itself and raises RuntimeError on a mismatch; callers check the
    key factors first so that a user sees which factor differs.
    """
    import torch

    from kiln.model.layer_regions import (
        CompiledLayers,  # and kiln::attention, which the split graph calls between pieces
    )

    manifest, signer = check_signed(_read_text(bundle_dir / MANIFEST), _read_signature(bundle_dir, key), key, trusted)
    if LAYER_KINDS not in manifest.files:
        raise UntrustedBundle(key, signer, f"its signed manifest lists no {LAYER_KINDS}")
    try:
        kinds = tuple(bounded_loads(_read_listed(bundle_dir, LAYER_KINDS, manifest, signer)))
    except ValueError:
        raise AlteredBundle(key, signer, f"{LAYER_KINDS} does not parse") from None
    files = [compiled_layer_file(kind) for kind in range(max(kinds) + 1)]
    missing = [name for name in files if name not in manifest.files]
    if missing:
        raise UntrustedBundle(key, signer, f"its signed manifest lists no {missing[0]}")
    data = [_read_listed(bundle_dir, name, manifest, signer) for name in files]
    code = tuple(torch.compiler.load_compiled_function(io.BytesIO(blob)) for blob in data)
    return CompiledLayers(code, kinds)
