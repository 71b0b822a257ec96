"""CompileService over gRPC: Compile (streamed progress), GetArtifact (streamed tar), ListArtifacts, DeleteArtifact."""

import asyncio
import hashlib
import logging
import time
from pathlib import Path

from compile_service.pipeline import CompileOutcome, compile_model
from kiln import bundle
from kiln.artifact_store import ArtifactStore, check_key
from kiln.compile_config import CompileConfig
from kiln.errors import InvalidArgument, NotFound
from kiln.grpc_server import UNGUARDED, ProgressEvents, Server, ServerSecurity, is_loopback, status_errors
from kiln.model_roots import ModelRoots
from kiln.model_spec import resolve
from kiln.signing import Signer, TrustedKeys
from kiln.store_location import open_store
from protos import common_pb2, compile_pb2, compile_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = compile_pb2.DESCRIPTOR.services_by_name["CompileService"].full_name
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kiln" / "compile-cache"


class CompileServicer(compile_pb2_grpc.CompileServiceServicer):
    def __init__(self, store: ArtifactStore, roots: ModelRoots):
        self.store = store
        self.roots = roots

    @status_errors
    async def Compile(self, request, context):
        config = CompileConfig.from_proto(request.config)
        model = resolve(request.model, config.device, self.roots)
        events = ProgressEvents()
        started = time.monotonic()

        def progress(phase: str, piece: int, num_pieces: int, size: str) -> None:
            events.emit(compile_pb2.CompileProgress(phase=phase, piece=piece, num_pieces=num_pieces, size=size,
                                                    elapsed_s=time.monotonic() - started))

        # to_thread runs the compile in a copy of this context, so its spans are children of this call's server span.
        job = asyncio.ensure_future(asyncio.to_thread(compile_model, model, config, self.store, progress))
        async for event in events.until_done(job):
            yield compile_pb2.CompileEvent(progress=event)
        yield compile_pb2.CompileEvent(result=_result(job.result()))

    @status_errors
    async def GetArtifact(self, request, context):
        path = self._bundle(request.key.digest)
        chunk = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        if not 0 < chunk <= MAX_CHUNK_BYTES:
            raise InvalidArgument(f"chunk_bytes: {chunk} must be in (0, {MAX_CHUNK_BYTES}]")
        data = await asyncio.to_thread(bundle.pack, path)
        yield compile_pb2.ArtifactChunk(header=compile_pb2.ArtifactHeader(
            sha256=hashlib.sha256(data).hexdigest(), total_bytes=len(data),
            manifest_json=(path / bundle.MANIFEST).read_text()))
        for offset in range(0, len(data), chunk):
            yield compile_pb2.ArtifactChunk(data=data[offset:offset + chunk])

    @status_errors
    async def ListArtifacts(self, request, context):
        infos = [
            compile_pb2.ArtifactInfo(
                key=common_pb2.ArtifactKey(digest=a.manifest.key), model=a.manifest.model,
                config_summary=a.manifest.config_summary, size_bytes=a.manifest.total_bytes,
                created_unix=a.manifest.created_unix, last_used_unix=a.last_used_unix,
                num_pieces=a.manifest.num_pieces)
            for a in self.store.list()
        ]
        return compile_pb2.ListArtifactsResponse(artifacts=infos)

    @status_errors
    async def DeleteArtifact(self, request, context):
        check_key(request.key.digest)
        freed = self.store.delete(request.key.digest)
        if not freed:
            raise NotFound(f"key: no artifact {request.key.digest}")
        return compile_pb2.DeleteArtifactResponse(freed_bytes=freed)

    def _bundle(self, digest: str) -> Path:
        check_key(digest)
        path = self.store.get(digest)
        if path is None:
            raise NotFound(f"key: no artifact {digest}; Compile it first")
        return path


def _result(outcome: CompileOutcome) -> compile_pb2.CompileResult:
    return compile_pb2.CompileResult(
        key=common_pb2.ArtifactKey(digest=outcome.key), cache_hit=outcome.cache_hit,
        timings=[common_pb2.PhaseTiming(phase=k, seconds=v) for k, v in outcome.timings.items()],
        bundle_bytes=outcome.bundle_bytes, num_pieces=outcome.num_pieces, total_s=outcome.total_s,
        num_splits=outcome.num_splits)


async def start_compile_server(store: str | Path, address: str, interceptors=(), *, signer: Signer,
                               trusted: TrustedKeys | None = None, security: ServerSecurity = UNGUARDED,
                               model_roots=(), cache_dir: str | Path = DEFAULT_CACHE_DIR,
                               lease_s: float | None = None) -> tuple[Server, int]:
    """Build, bind and start; returns the server and its port (address may say port 0).

    ``store`` is a directory or ``redis://...``; a Redis store keeps verified local copies of its bundles in
    ``cache_dir`` and holds a lease of ``lease_s`` seconds (renewed while it compiles) on each key it compiles.
    Every bundle committed is signed with ``signer``; a bundle in the store counts as present only when it verifies
    against the signer's own key or one of ``trusted`` (a rotated-out key whose bundles are still good).
    """
    trusted = (trusted or TrustedKeys([])).with_key(signer.public_key)
    bundles = open_store(store, cache_dir, lease_s=lease_s, signer=signer, trusted=trusted)
    roots = ModelRoots.for_server(model_roots, loopback=is_loopback(address))
    server = Server([SERVICE_NAME], interceptors, security)
    compile_pb2_grpc.add_CompileServiceServicer_to_server(CompileServicer(bundles, roots), server.server)
    port = await server.start(address)
    log.info("compile service listening on %s (port %d), store %s, signing as %s, model roots: %s", address, port,
             bundles.location, signer.key_id, roots.describe())
    return server, port
