"""CompileService over gRPC: Compile (streamed progress), GetArtifact (the bundle streamed from disk, checked as it
is read), ListArtifacts, DeleteArtifact."""

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from compile_service.metrics import CompileMetrics
from compile_service.pipeline import CompileOutcome, compile_model, look_up
from kiln.compilation.code_hash import kiln_code_hash
from kiln.compilation.config import CompileConfig
from kiln.errors import InvalidArgument, KilnError, NotFound
from kiln.model.hub import HubCache
from kiln.model.roots import ModelRoots
from kiln.model.spec import resolve
from kiln.rpc.grpc_server import (
    UNGUARDED,
    ProgressEvents,
    Server,
    ServerSecurity,
    in_worker_thread,
    is_loopback,
    status_errors,
)
from kiln.store import bundle
from kiln.store.artifact_store import ArtifactStore, check_key, is_key
from kiln.store.bundle import CorruptBundle, UntrustedBundle
from kiln.store.location import open_store
from kiln.store.signing import Signer, TrustedKeys
from protos import common_pb2, compile_pb2, compile_pb2_grpc
from tracing.grpc_instrumentation import server_interceptors

log = logging.getLogger(__name__)

SERVICE_NAME = compile_pb2.DESCRIPTOR.services_by_name["CompileService"].full_name
# GetArtifact's chunk_bytes: 0 means the default; outside the bounds is INVALID_ARGUMENT. The floor keeps a bundle
# from becoming millions of messages, the ceiling keeps each one far below the message size limit.
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 4 << 20
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kiln" / "compile-cache"


class CompileServicer(compile_pb2_grpc.CompileServiceServicer):
    def __init__(self, store: ArtifactStore, roots: ModelRoots, trusted: TrustedKeys,
                 metrics: CompileMetrics | None = None):
        self.store = store
        self.roots = roots
        self.trusted = trusted  # what the store's bundles must be signed by: GetArtifact checks as it streams
        self.metrics = metrics  # --metrics-port: each compile's result and seconds

    @status_errors
    async def Compile(self, request, context):
        config = CompileConfig.from_proto(request.config)
        model = resolve(request.model, config.device, self.roots)
        if request.key_only:
            yield compile_pb2.CompileEvent(result=_result(await asyncio.to_thread(look_up, model, config, self.store)))
            return
        events = ProgressEvents()
        started = time.monotonic()

        def progress(phase: str, piece: int, num_pieces: int, size: str, region: str) -> None:
            events.emit(compile_pb2.CompileProgress(phase=phase, piece=piece, num_pieces=num_pieces, size=size,
                                                    region=region, elapsed_s=time.monotonic() - started))

        # The worker thread runs in a copy of this context, so the compile's spans are children of this call's span.
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        job = in_worker_thread(compile_model, model, config, self.store, progress, deadline)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even when the client left
        try:
            async for event in events.until_done(job):
                yield compile_pb2.CompileEvent(progress=event)
            outcome = job.result()
        except Exception as exc:
            if self.metrics:
                self.metrics.failed(exc.code if isinstance(exc, KilnError) else "INTERNAL")
            raise
        if self.metrics:
            self.metrics.compiled(outcome)
        yield compile_pb2.CompileEvent(result=_result(outcome))

    @status_errors
    async def GetArtifact(self, request, context):
        chunk_bytes = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(f"chunk_bytes: {chunk_bytes} is outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] "
                                  f"(0 means {DEFAULT_CHUNK_BYTES})")
        key = request.key.digest
        path = self._bundle(key, check=False)  # checked below, as it is read: one pass over the bytes
        try:
            manifest_json, signature_json, manifest = await asyncio.to_thread(bundle.read_signed, path, key,
                                                                              self.trusted)
            chunks = bundle.read_chunks(path, manifest, chunk_bytes)
            yield compile_pb2.ArtifactChunk(header=compile_pb2.ArtifactHeader(
                total_bytes=manifest.total_bytes, manifest_json=manifest_json, signature_json=signature_json))
            while (data := await asyncio.to_thread(next, chunks, None)) is not None:
                yield compile_pb2.ArtifactChunk(data=data)
        except (CorruptBundle, UntrustedBundle) as exc:
            await asyncio.to_thread(self._recheck, key)
            raise CorruptBundle(f"key: bundle {key[:12]} does not match its manifest ({exc}); it is quarantined and "
                                f"the next Compile rebuilds it") from None

    @status_errors
    async def ListArtifacts(self, request, context):
        listing = await asyncio.to_thread(self.store.list)
        infos = [
            compile_pb2.ArtifactInfo(
                key=common_pb2.ArtifactKey(digest=a.manifest.key), model=a.manifest.model,
                config_summary=a.manifest.config_summary, size_bytes=a.manifest.total_bytes,
                created_unix=a.manifest.created_unix, last_used_unix=a.last_used_unix,
                num_pieces=a.manifest.num_pieces)
            for a in listing.artifacts
        ]
        for name in filter(is_key, listing.unreadable):  # a writer's get takes a bad entry out of the store
            await asyncio.to_thread(self._recheck, name)
        return compile_pb2.ListArtifactsResponse(artifacts=infos, unreadable=[
            compile_pb2.UnreadableArtifact(name=name, reason=reason) for name, reason in listing.unreadable.items()])

    @status_errors
    async def DeleteArtifact(self, request, context):
        check_key(request.key.digest)
        freed = self.store.delete(request.key.digest)
        if not freed:
            raise NotFound(f"key: no artifact {request.key.digest}")
        return compile_pb2.DeleteArtifactResponse(freed_bytes=freed)

    def _bundle(self, digest: str, check: bool = True) -> Path:
        check_key(digest)
        path = self.store.get(digest, check)
        if path is None:
            raise NotFound(f"key: no artifact {digest}; Compile it first")
        return path

    def _recheck(self, key: str) -> None:
        """A bundle failed its check while streamed: look again under its lock, which quarantines it if it still
        fails (and leaves it alone if a rebuild just replaced it)."""
        with self.store.lock(key):
            self.store.get(key)


def _result(outcome: CompileOutcome) -> compile_pb2.CompileResult:
    return compile_pb2.CompileResult(
        key=common_pb2.ArtifactKey(digest=outcome.key), cache_hit=outcome.cache_hit,
        timings=[common_pb2.PhaseTiming(phase=k, seconds=v) for k, v in outcome.timings.items()],
        bundle_bytes=outcome.bundle_bytes, num_pieces=outcome.num_pieces, total_s=outcome.total_s,
        num_splits=outcome.num_splits, key_factors_json=json.dumps(outcome.factors, sort_keys=True, default=str))


@dataclass(frozen=True)
class CompileServerSettings:
    """Where the compile service listens, where its bundles go, and who signs and may read them.

    ``store`` is a directory or ``redis://...``; a Redis store keeps verified local copies of its bundles in
    ``cache_dir`` and holds a lease of ``lease_s`` seconds (renewed while it compiles) on each key it compiles.
    Every bundle committed is signed with ``signer``; a bundle in the store counts as present only when it verifies
    against the signer's own key or one of ``trusted`` (a rotated-out key whose bundles are still good).
    """

    address: str  # host:port; port 0 picks a free one
    store: str | Path
    signer: Signer
    trusted: TrustedKeys | None = None
    security: ServerSecurity = UNGUARDED  # TLS and tokens of this server
    model_roots: tuple[str | Path, ...] = ()  # the directories a request may name
    cache_dir: str | Path = DEFAULT_CACHE_DIR
    lease_s: float | None = None  # None: the Redis store's default
    hub: HubCache | None = None  # where Hub ids resolve (--hub-cache); None: they are refused


async def start_compile_server(settings: CompileServerSettings, metrics: CompileMetrics | None = None
                               ) -> tuple[Server, int]:
    """Build, bind and start; returns the server and its port. Spans follow what init_tracing installed in this
    process (nothing when it did not run); ``metrics`` (--metrics-port) count each compile."""
    await asyncio.to_thread(kiln_code_hash)  # every key needs it: parsed once here, never in a request's thread
    signer = settings.signer
    trusted = (settings.trusted or TrustedKeys([])).with_key(signer.public_key)
    bundles = open_store(settings.store, settings.cache_dir, lease_s=settings.lease_s, signer=signer, trusted=trusted)
    roots = ModelRoots.for_server(settings.model_roots, loopback=is_loopback(settings.address), hub=settings.hub)
    server = Server([SERVICE_NAME], server_interceptors(), settings.security)
    compile_pb2_grpc.add_CompileServiceServicer_to_server(CompileServicer(bundles, roots, trusted, metrics),
                                                      server.server)
    port = await server.start(settings.address)
    log.info("compile service listening on %s (port %d), store %s, signing as %s, model roots: %s", settings.address,
             port, bundles.location, signer.key_id, roots.describe())
    return server, port
