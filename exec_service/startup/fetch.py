"""Fetch a compiled bundle: from the local cache or a shared store (a directory or Redis), else Compile +
GetArtifact on the compile service. A replica with a shared store and no compile service serves whatever the store
holds.

A bundle is only ever served after its manifest's signature verifies against a trusted key, its sha256s check out
and its key factors match this process: an unsigned, unknown-signer or tampered bundle is refused with
FAILED_PRECONDITION naming the key and the signer, and one built for another torch, Python or device with
FAILED_PRECONDITION naming the factor; never loaded into a crash and never silently recompiled here.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from kiln import bundle, cache_key
from kiln.artifact_store import ArtifactStore, check_key
from kiln.bundle import CorruptBundle, UntrustedBundle
from kiln.compile_config import CompileConfig
from kiln.errors import FailedPrecondition, Internal, KilnError, NotFound
from kiln.model_spec import ResolvedModel
from kiln.signing import TrustedKeys
from protos import common_pb2, compile_pb2, compile_pb2_grpc

log = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]


class CompileServiceError(KilnError):
    """A failed call to the compile service, reported with the status the compile service gave."""

    def __init__(self, exc: grpc.RpcError):
        super().__init__(f"compile service: {exc.details()}")
        self.code = exc.code()


@dataclass
class FetchedBundle:
    key: str
    path: Path
    factors: dict
    # How it got here: "local cache", "shared store redis://...", "downloaded 1.2 MB from the compile service".
    source: str

    @property
    def max_num_batched_tokens(self) -> int:
        """Upper end of the compiled symbolic token range: no step may be larger."""
        return self.factors["compile_config"]["max_num_batched_tokens"]


class BundleFetcher:
    """Bundles by key. ``store`` is a shared store (a directory read in place, or Redis copied into a local cache)
    or this server's own download cache; ``trusted`` the keys whose signatures it accepts."""

    def __init__(self, store: ArtifactStore, shared: bool, compile_channel: grpc.Channel | None,
                 trusted: TrustedKeys):
        self.store = store
        self.shared = shared
        self.trusted = trusted
        self.compile_stub = compile_pb2_grpc.CompileServiceStub(compile_channel) if compile_channel else None

    def fetch(self, spec: common_pb2.ModelSpec, resolved: ResolvedModel, config: CompileConfig, key: str | None,
              progress: ProgressFn = lambda detail: None) -> FetchedBundle:
        """The bundle for ``key``, or for the model of ``spec`` under ``config``, compiled on the compile service
        on a miss."""
        if key is not None:
            check_key(key)
        # What this process would compile: when the store has it, no call to the compile service is needed.
        digest = key or cache_key.digest(cache_key.key_factors(resolved, config))
        with self.store.lock(digest):
            path = self.store.get(digest)
        source = self._found_in
        if path is None:
            if self.compile_stub is None:
                raise NotFound(f"key: no bundle {digest} in {self._found_in}, and this exec server has no compile "
                               f"service (--compile-server) to compile it")
            if key is None:
                digest = self._compile(_wire_spec(spec, resolved), config, progress)
            path, source = self._get_or_download(digest, progress)
        self._verify_signature(digest, path)
        fetched = FetchedBundle(digest, path, self._read_factors(path), source)
        check_environment(fetched, config.device)
        if key is not None:
            check_model(fetched, resolved)
        return fetched

    @property
    def _found_in(self) -> str:
        """The source of a bundle that was already in ``store``."""
        return f"shared store {self.store.location}" if self.shared else "local cache"

    def _compile(self, spec: common_pb2.ModelSpec, config: CompileConfig, progress: ProgressFn) -> str:
        stub = self.compile_stub
        request = compile_pb2.CompileRequest(model=spec, config=config.to_proto())
        result = None
        try:
            # Read to the stream's end, past the result: the call (and its client span) ends here, not when the
            # abandoned iterator is collected.
            for event in stub.Compile(request):
                if event.HasField("result"):
                    result = event.result
                    hit = "hit" if result.cache_hit else f"compiled in {result.total_s:.1f}s"
                    progress(f"compile service: {hit}, key {result.key.digest}")
                else:
                    p = event.progress
                    piece = f" piece {p.piece}/{p.num_pieces} size {p.size}" if p.phase == "inductor" else ""
                    progress(f"compile service: {p.phase}{piece} at {p.elapsed_s:.1f}s")
        except grpc.RpcError as exc:
            raise CompileServiceError(exc) from None
        if result is None:
            raise Internal("compile service: the Compile stream ended without a result")
        return result.key.digest

    def _get_or_download(self, digest: str, progress: ProgressFn) -> tuple[Path, str]:
        with self.store.lock(digest):
            path = self.store.get(digest)
            if path is not None:
                return path, self._found_in
            if self.shared:
                raise NotFound(f"key: no bundle {digest} in the {self._found_in}: the compile service must use the "
                               f"same store")
            size = self._download(digest, progress)
            path = self.store.get(digest)
            if path is None:
                raise CorruptBundle(f"bundle {digest} failed verification after download")
            return path, f"downloaded {size / 1e6:.2f} MB from the compile service"

    def _download(self, digest: str, progress: ProgressFn) -> int:
        stub = self.compile_stub
        request = compile_pb2.GetArtifactRequest(key=common_pb2.ArtifactKey(digest=digest))
        header, chunks = None, []
        try:
            for chunk in stub.GetArtifact(request):
                if chunk.HasField("header"):
                    header = chunk.header
                    progress(f"downloading {header.total_bytes / 1e6:.2f} MB")
                else:
                    chunks.append(chunk.data)
        except grpc.RpcError as exc:
            raise CompileServiceError(exc) from None
        if header is None:
            raise CorruptBundle(f"GetArtifact {digest}: no header")
        data = b"".join(chunks)
        staged = self.store.staging_dir()
        staged.rmdir()  # unpack creates it, and refuses a directory that exists
        try:
            bundle.unpack(data, header.sha256, staged)
            self.store.commit(digest, staged)
        except Exception:
            self.store.discard(staged)
            raise
        return len(data)

    def _verify_signature(self, digest: str, path: Path) -> None:
        """Nothing of a bundle is read as more than bytes before this; a refused one leaves this server's own cache,
        so a later fetch downloads it again (a shared store is the compile service's to clean)."""
        try:
            bundle.verify_signed(path, digest, self.trusted)
        except UntrustedBundle as exc:
            log.warning("refused bundle %s: %s", digest[:12], exc)
            if not self.shared:
                self.store.delete(digest)
            raise

    @staticmethod
    def _read_factors(path: Path) -> dict:
        try:
            return json.loads((path / bundle.KEY_FACTORS).read_text())
        except (OSError, ValueError) as exc:
            raise CorruptBundle(f"{path.name}: unreadable {bundle.KEY_FACTORS}: {exc}") from None


def check_environment(fetched: FetchedBundle, device: str) -> None:
    """FAILED_PRECONDITION naming every factor of this process that differs from the bundle's."""
    mismatches = cache_key.mismatched_environment(fetched.factors.get("environment", {}), device)
    if mismatches:
        reasons = "; ".join(f"{name} {stored}, this process has {here}" for name, stored, here in mismatches)
        raise FailedPrecondition(f"bundle {fetched.key[:12]} was compiled for {reasons}")


def check_model(fetched: FetchedBundle, resolved: ResolvedModel) -> None:
    """A bundle asked for by key must have been compiled for this model's config and dtype."""
    if fetched.factors.get("dtype") != resolved.dtype_name:
        raise FailedPrecondition(f"key: bundle {fetched.key[:12]} was compiled for dtype {fetched.factors.get('dtype')}"
                                 f", the model is {resolved.dtype_name}")
    stored = fetched.factors.get("model_config", {})
    here = json.loads(json.dumps(resolved.normalized_config(), default=str))
    differing = sorted(k for k in set(stored) | set(here) if stored.get(k) != here.get(k))
    if differing:
        shown = ", ".join(f"{k} {stored.get(k)!r} vs {here.get(k)!r}" for k in differing[:3])
        raise FailedPrecondition(f"key: bundle {fetched.key[:12]} was compiled for another model config ({shown})")


def _wire_spec(spec: common_pb2.ModelSpec, resolved: ResolvedModel) -> common_pb2.ModelSpec:
    """The spec as the compile service must see it: a local directory travels as its config.json (the compile
    service may run elsewhere), the dtype explicitly (its default depends on its own device)."""
    wire = common_pb2.ModelSpec(dtype=resolved.dtype_name)
    if spec.WhichOneof("source") == "hf_dir":
        wire.config_json = (resolved.hf_dir / "config.json").read_text()  # the path the model roots checked
    elif spec.WhichOneof("source") == "preset":
        wire.preset = spec.preset
    else:
        wire.config_json = spec.config_json
    return wire
