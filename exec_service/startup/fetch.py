"""Fetch a compiled bundle: from the local cache or a shared store (a directory or Redis), else Compile +
GetArtifact on the compile service. A replica with a shared store and no compile service serves whatever the store
holds.

A bundle is only ever served after its manifest's signature verifies against a trusted key, its sha256s check out
and every one of its key factors matches: this process's versions, device and Kiln code, and the model, dtype and
compile config asked for. An unsigned, unknown-signer or tampered bundle is refused with FAILED_PRECONDITION naming
the key and the signer, and one built for another torch, Python, device or model with FAILED_PRECONDITION naming the
factor; never loaded into a crash and never silently recompiled here. A download goes from the wire to the cache's
staging directory chunk by chunk, each file checked as it is written; a bundle whose bytes fail their check
(DATA_LOSS, here or at the compile service) is compiled again, once.

The channel to the compile service waits for it to be ready and retries a call it refused as UNAVAILABLE (gRPC's
own retry policy, from the service config below), both within the LoadModel's deadline: a compile service that
restarts while a model loads costs the wait, not the load.
"""

import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import grpc

from kiln.compilation import cache_key
from kiln.compilation.code_hash import kiln_code_hash
from kiln.compilation.config import CompileConfig
from kiln.errors import DataLoss, FailedPrecondition, Internal, KilnError, NotFound, Unavailable, resource_error
from kiln.json_object import bounded_loads
from kiln.model.factors import model_config_factors
from kiln.model.spec import ResolvedModel
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store import bundle
from kiln.store.artifact_store import ArtifactStore, check_key
from kiln.store.bundle import CorruptBundle, UntrustedBundle
from kiln.store.signing import TrustedKeys
from protos import common_pb2, compile_pb2, compile_pb2_grpc
from tracing import spans

log = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]
# Times one named step of the fetch (a span and a progress event in LoadModel's startup phases).
StepFn = Callable[[str], AbstractContextManager[None]]


def _untimed(step: str) -> AbstractContextManager[None]:
    return nullcontext()

# How long a LoadModel without a deadline waits for an unreachable compile service before it gives up.
DEFAULT_WAIT_S = 60.0
_SERVICE_CONFIG = {"methodConfig": [{
    "name": [{"service": compile_pb2.DESCRIPTOR.services_by_name["CompileService"].full_name}],
    "waitForReady": True,
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "2s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"]},
}]}
# The service config, and reconnect backoff capped at 2 s (gRPC's own grows to 2 minutes while the server is away,
# which is how long a restarted compile service would go unnoticed).
COMPILE_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS, ("grpc.service_config", json.dumps(_SERVICE_CONFIG)), ("grpc.enable_retries", 1),
    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class CompileServiceError(KilnError):
    """A failed call to the compile service, reported with the status the compile service gave."""

    def __init__(self, exc: grpc.RpcError):
        super().__init__(f"compile service: {exc.details()}")
        self.code = exc.code().name


def _failed_call(exc: grpc.RpcError) -> KilnError:
    """DATA_LOSS from the compile service is a bundle that failed its check there: CorruptBundle, compiled again."""
    if exc.code() == grpc.StatusCode.DATA_LOSS:
        return CorruptBundle(f"compile service: {exc.details()}")
    return CompileServiceError(exc)


@dataclass
class FetchedBundle:
    key: str
    path: Path
    factors: dict
    # How it got here: "local cache", "shared store redis://...", "downloaded 1.2 MB from the compile service".
    source: str

    @property
    def max_compiled_tokens(self) -> int:
        """Upper end of the compiled symbolic token range: no step may be larger."""
        return self.factors["compile_config"]["max_compiled_tokens"]

    @property
    def compile_sizes(self) -> tuple[int, ...]:
        """Token counts compiled statically besides the symbolic range: code of their own to warm up."""
        return tuple(self.factors["compile_config"].get("compile_sizes", ()))


class BundleFetcher:
    """Bundles by key. ``store`` is a shared store (a directory read in place, or Redis copied into a local cache)
    or this server's own download cache; ``trusted`` the keys whose signatures it accepts."""

    def __init__(self, store: ArtifactStore, shared: bool, compile_channel: grpc.Channel | None,
                 trusted: TrustedKeys):
        self.store = store
        self.shared = shared
        self.trusted = trusted
        self.compile_channel = compile_channel
        self.compile_stub = compile_pb2_grpc.CompileServiceStub(compile_channel) if compile_channel else None

    def fetch(self, spec: common_pb2.ModelSpec, resolved: ResolvedModel, config: CompileConfig, key: str | None,
              progress: ProgressFn = lambda detail: None, deadline: float | None = None,
              step: StepFn = _untimed) -> FetchedBundle:
        """The bundle for ``key``, or for the model of ``spec`` under ``config``, compiled on the compile service
        on a miss. ``deadline`` (time.monotonic()) bounds every call to the compile service; ``step`` times the
        key, the verification and the factor check."""
        if key is not None:
            check_key(key)
        calls = _Calls(deadline)
        try:
            fetched = self._fetch(spec, resolved, config, key, progress, calls, step)
        except CorruptBundle as exc:
            if key is not None or self.compile_stub is None:
                raise
            # The compile service checks its own copy as it answers, and rebuilds one that fails.
            log.warning("%s; compiling it again", exc)
            progress(f"the bundle failed its check ({exc}); compiling again")
            fetched = self._fetch(spec, resolved, config, key, progress, calls, step, cached=False)
        with step(spans.CHECK_FACTORS):
            check_factors(fetched, resolved, config, by_key=key is not None)
        return fetched

    def _fetch(self, spec: common_pb2.ModelSpec, resolved: ResolvedModel, config: CompileConfig, key: str | None,
               progress: ProgressFn, calls: "_Calls", step: StepFn, cached: bool = True) -> FetchedBundle:
        # What this process would compile: when the store has it, no call to the compile service is needed.
        digest = key
        if digest is None:
            with step(spans.BUNDLE_KEY):
                digest = cache_key.digest(cache_key.key_factors(resolved, config))
        path = None
        if cached:
            with self.store.lock(digest, calls.deadline):
                path = self.store.get(digest)
        source = self._found_in
        if path is None:
            if self.compile_stub is None:
                raise NotFound(f"key: no bundle {digest} in {self._found_in}, and this exec server has no compile "
                               f"service (--compile-server) to compile it")
            if key is None:
                digest = self._compile(_wire_spec(spec, resolved), config, progress, calls)
            path, source = self._get_or_download(digest, progress, calls)
        with step(spans.VERIFY):
            self._verify_signature(digest, path)
        return FetchedBundle(digest, path, self._read_factors(path), source)

    @property
    def _found_in(self) -> str:
        """The source of a bundle that was already in ``store``."""
        return f"shared store {self.store.location}" if self.shared else "local cache"

    def _compile(self, spec: common_pb2.ModelSpec, config: CompileConfig, progress: ProgressFn,
                 calls: "_Calls") -> str:
        request = compile_pb2.CompileRequest(model=spec, config=config.to_proto())
        result = None
        calls.wait_ready(self.compile_channel)
        try:
            # Read to the stream's end, past the result: the call (and its client span) ends here, not when the
            # abandoned iterator is collected.
            for event in self.compile_stub.Compile(request, timeout=calls.timeout(), wait_for_ready=True):
                if event.HasField("result"):
                    result = event.result
                    hit = "hit" if result.cache_hit else f"compiled in {result.total_s:.1f}s"
                    progress(f"compile service: {hit}, key {result.key.digest}")
                else:
                    p = event.progress
                    region = f" {p.region}" if p.region else ""
                    piece = f" piece {p.piece}/{p.num_pieces} size {p.size}" if p.phase == "inductor" else ""
                    progress(f"compile service: {p.phase}{region}{piece} at {p.elapsed_s:.1f}s")
        except grpc.RpcError as exc:
            raise _failed_call(exc) from None
        if result is None:
            raise Internal("compile service: the Compile stream ended without a result")
        return result.key.digest

    def _get_or_download(self, digest: str, progress: ProgressFn, calls: "_Calls") -> tuple[Path, str]:
        with self.store.lock(digest, calls.deadline):
            path = self.store.get(digest)
            if path is not None:
                return path, self._found_in
            if self.shared:
                raise NotFound(f"key: no bundle {digest} in the {self._found_in}: the compile service must use the "
                               f"same store")
            path, size = self._download(digest, progress, calls)
            return path, f"downloaded {size / 1e6:.2f} MB from the compile service"

    def _download(self, digest: str, progress: ProgressFn, calls: "_Calls") -> tuple[Path, int]:
        """GetArtifact straight into a staging directory of the cache, then committed: (its path, its bytes). The
        manifest's signature is checked before anything is written, each file as it is."""
        request = compile_pb2.GetArtifactRequest(key=common_pb2.ArtifactKey(digest=digest))
        calls.wait_ready(self.compile_channel)
        where = f"download into the cache {self.store.location}"
        try:
            staged = self.store.staging_dir()
        except OSError as exc:
            raise resource_error(exc, where) or exc from exc
        try:
            responses = self.compile_stub.GetArtifact(request, timeout=calls.timeout(), wait_for_ready=True)
            first = next(responses, None)
            if first is None or first.WhichOneof("payload") != "header":
                raise CorruptBundle(f"GetArtifact {digest[:12]}: the stream does not start with its header")
            header = first.header
            manifest, _ = bundle.check_signed(header.manifest_json, header.signature_json, digest, self.trusted)
            if manifest.total_bytes != header.total_bytes:
                raise CorruptBundle(f"GetArtifact {digest[:12]}: the header's size is not its manifest's")
            progress(f"downloading {header.total_bytes / 1e6:.2f} MB")
            bundle.write_chunks(header.manifest_json, header.signature_json, (_data(c) for c in responses), staged)
            return self.store.commit(digest, staged), header.total_bytes
        except grpc.RpcError as exc:
            self.store.discard(staged)
            raise _failed_call(exc) from None
        except OSError as exc:
            self.store.discard(staged)
            raise resource_error(exc, where) or exc from exc
        except BaseException:
            self.store.discard(staged)
            raise

    def _verify_signature(self, digest: str, path: Path) -> None:
        """Nothing of a bundle is read as more than bytes before this; a refused one leaves this server's own cache
        for its quarantine, so a later fetch downloads it again (a shared store is the compile service's to clean)."""
        try:
            bundle.verify_signed(path, digest, self.trusted)
        except (UntrustedBundle, CorruptBundle) as exc:
            log.warning("refused bundle %s: %s", digest[:12], exc)
            if not self.shared:
                with self.store.lock(digest):
                    self.store.quarantine(digest, str(exc))
            raise

    @staticmethod
    def _read_factors(path: Path) -> dict:
        try:
            with bundle.open_regular(path / bundle.KEY_FACTORS) as f:
                return bounded_loads(f.read())  # its sha256 was checked: signed bytes
        except (OSError, ValueError) as exc:
            raise CorruptBundle(f"{path.name}: unreadable {bundle.KEY_FACTORS}: {exc}") from None


class _Calls:
    """The calls of one fetch to the compile service, within one deadline."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline

    def timeout(self) -> float | None:
        """What is left of the deadline for the next call; None (no deadline) lets a long compile run."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def wait_ready(self, channel: grpc.Channel) -> None:
        """Wait for the channel to connect, up to the deadline (or DEFAULT_WAIT_S without one): UNAVAILABLE after.

        The calls wait for ready themselves; this bounds the wait of a call that has no deadline of its own.
        """
        wait = DEFAULT_WAIT_S if self.deadline is None else self.timeout()
        try:
            grpc.channel_ready_future(channel).result(timeout=wait)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"compile service: not reachable within {wait:.0f} s; is --compile-server right and "
                              f"the compile service up?") from None


def _data(chunk: compile_pb2.ArtifactChunk) -> bytes:
    if chunk.WhichOneof("payload") != "data":
        raise CorruptBundle("GetArtifact: a second header inside the stream")
    return chunk.data


def check_factors(fetched: FetchedBundle, resolved: ResolvedModel, config: CompileConfig, by_key: bool) -> None:
    """Refuse, naming the factor, a bundle not built for this process or not for the model and config asked for.

    The environment and Kiln's code must be this process's; the model config and dtype the request's; the compile
    config the request's too, unless the request named the bundle by key (then the bundle's own governs, on the
    request's device). The compiler settings are the compile service's, not this process's: what is checked of
    them is that the request's Inductor patches hold. Last, the factors must hash to the key they came under.
    """
    stored = fetched.factors
    expected = {
        "environment": cache_key.environment_factors(config.device),
        "kiln_code": kiln_code_hash(),
        "model_config": model_config_factors(resolved),
        "dtype": resolved.dtype_name,
        "compile_config": cache_key.compile_config_factors(config),
    }
    if by_key:
        expected["compile_config"] = {**stored.get("compile_config", {}), "device": config.device,
                                      "tensor_parallel_size": config.tensor_parallel_size}
    for group, here in expected.items():
        mismatches = cache_key.differences({group: stored.get(group)}, {group: here})
        if mismatches:
            reasons = "; ".join(f"{name} {old}, {_whose(group)} {new}" for name, old, new in mismatches[:4])
            more = f" (and {len(mismatches) - 4} more)" if len(mismatches) > 4 else ""
            raise FailedPrecondition(f"bundle {fetched.key[:12]} was compiled for {reasons}{more}")
    inductor = stored.get("compiler", {}).get("inductor", {})
    for name, value in config.inductor_config_patches.items():
        if name in inductor and cache_key.differences(inductor[name], value):
            raise FailedPrecondition(f"bundle {fetched.key[:12]} was compiled with Inductor option {name} "
                                     f"{inductor[name]}, the request asks for {value}")
    if cache_key.digest(stored) != fetched.key:
        raise DataLoss(f"bundle {fetched.key[:12]}: its {bundle.KEY_FACTORS} hashes to "
                       f"{cache_key.digest(stored)[:12]}, not to the key it is stored under")


def _whose(group: str) -> str:
    return "this process has" if group in ("environment", "kiln_code") else "the request asks for"


def _wire_spec(spec: common_pb2.ModelSpec, resolved: ResolvedModel) -> common_pb2.ModelSpec:
    """The spec as the compile service must see it: a local directory travels as its config.json (the compile
    service may run elsewhere), the dtype explicitly (its default depends on its own device)."""
    wire = common_pb2.ModelSpec(dtype=resolved.dtype_name)
    if spec.WhichOneof("source") in ("hf_dir", "hub_id"):
        wire.config_json = (resolved.hf_dir / "config.json").read_text()  # the file the model roots pinned
    elif spec.WhichOneof("source") == "preset":
        wire.preset = spec.preset
    else:
        wire.config_json = spec.config_json
    return wire
