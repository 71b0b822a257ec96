"""ExecService over gRPC: LoadModel (streamed phases), UnloadModel, ListModels, Generate (streamed), GetForwardStats.

Every model's readiness is in the health service under ``kiln.v1.ExecService/<model name>``: NOT_SERVING while
it loads or after a failed load, SERVING once it is ready.
"""

import asyncio
import gc
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from exec_service.api.detokenizer import Detokenizer
from exec_service.api.served_model import ServedModel
from exec_service.engine.engine_loop import StepObserver
from exec_service.startup.fetch import BundleFetcher
from exec_service.startup.load_model import LoadTarget, StartedModel, start_model
from exec_service.telemetry.forward_stats import ForwardStats
from exec_service.telemetry.request_spans import RequestSpans
from kiln import bundle
from kiln.artifact_store import FilesystemStore
from kiln.client_security import PLAINTEXT, ClientSecurity
from kiln.errors import AlreadyExists, FailedPrecondition, KilnError, NotFound, first_line, quote
from kiln.grpc_server import (
    CHANNEL_OPTIONS,
    UNGUARDED,
    ProgressEvents,
    Server,
    ServerSecurity,
    is_loopback,
    status_errors,
)
from kiln.model_roots import ModelRoots
from kiln.signing import TrustedKeys
from protos import exec_pb2, exec_pb2_grpc
from tracing.grpc_instrumentation import instrumented_channel

log = logging.getLogger(__name__)

SERVICE_NAME = exec_pb2.DESCRIPTOR.services_by_name["ExecService"].full_name
DEFAULT_CACHE_DIR = os.environ.get("KILN_EXEC_CACHE", str(Path.home() / ".cache" / "kiln" / "exec-cache"))


def health_name(model: str) -> str:
    return f"{SERVICE_NAME}/{model}"


class ExecServicer(exec_pb2_grpc.ExecServiceServicer):
    def __init__(self, server: Server, fetcher: BundleFetcher, forward_stats: ForwardStats,
                 step_observers: list[StepObserver], request_spans: RequestSpans, roots: ModelRoots):
        self.server = server
        self.fetcher = fetcher
        self.roots = roots
        self.forward_stats = forward_stats
        self.step_observers = step_observers  # handed to every engine: forward spans hang here
        self.request_spans = request_spans  # forward spans watch them, to link to the requests they served
        self.models: dict[str, ServedModel] = {}

    @status_errors
    async def LoadModel(self, request, context):
        target = LoadTarget.from_request(request, self.roots)
        previous = self.models.get(target.name)
        if previous is not None and previous.state != exec_pb2.MODEL_STATE_FAILED:
            raise AlreadyExists(f"name: a model named {quote(target.name)} is already loaded or loading; unload it "
                                f"or choose another name")
        served = self.models[target.name] = ServedModel(target.name)
        await self.server.set_serving(health_name(target.name), False)
        progress = ProgressEvents()
        # A task of its own: the load completes (or fails) and updates the model even if this client goes away. Task
        # and thread run in copies of this context, so the startup spans are children of this call's server span.
        load = asyncio.ensure_future(self._load(served, target, progress.emit))
        async for phase in progress.until_done(load):
            yield exec_pb2.LoadModelEvent(phase=phase)
        yield exec_pb2.LoadModelEvent(ready=load.result().sizing)

    async def _load(self, served: ServedModel, target: LoadTarget, emit) -> StartedModel:
        try:
            started = await asyncio.to_thread(start_model, target, self.fetcher, self.forward_stats,
                                              self.step_observers, emit)
        except Exception as exc:
            served.state = exec_pb2.MODEL_STATE_FAILED
            served.error = str(exc) if isinstance(exc, KilnError) else first_line(exc)
            log.warning("%s: load failed: %s", target.name, served.error)
            raise
        served.started = started
        served.state = exec_pb2.MODEL_STATE_READY
        await self.server.set_serving(health_name(target.name), True)
        return started

    @status_errors
    async def UnloadModel(self, request, context):
        served = self._model(request.name, "name")
        if served.state == exec_pb2.MODEL_STATE_LOADING:
            raise FailedPrecondition(f"name: {quote(request.name)} is still loading; unload it once LoadModel ends")
        del self.models[request.name]
        await self.server.set_serving(health_name(request.name), False)
        if served.started is not None:
            await asyncio.to_thread(_release, served)
        log.info("%s: unloaded", request.name)
        return exec_pb2.UnloadModelResponse()

    @status_errors
    async def ListModels(self, request, context):
        return exec_pb2.ListModelsResponse(models=[m.info() for m in self.models.values()])

    @status_errors
    async def Generate(self, request, context):
        served = self._model(request.model, "model")
        engine = served.engine()
        seq = served.new_sequence(request)
        with self.request_spans.track(served.name, seq):
            stream = engine.add_request(seq)
            detokenizer = Detokenizer(served.started.tokenizer) if served.started.tokenizer else None
            done = False
            try:
                async for output in stream:
                    if output.error is not None:
                        raise output.error
                    done = output.is_last
                    yield exec_pb2.GenerateResponse(
                        token_ids=output.token_ids, text=detokenizer.add(output.token_ids) if detokenizer else "",
                        finish_reason=output.finish_reason, usage=output.usage)
            finally:
                if not done:  # cancelled, deadline passed, or the client went away: free the blocks now
                    engine.abort(seq.request_id)

    @status_errors
    async def GetForwardStats(self, request, context):
        stats = self.forward_stats.snapshot(request.model or None, request.reset)
        if request.model and not stats and request.model not in self.models:
            raise NotFound(f"model: no model named {quote(request.model)}")
        return exec_pb2.GetForwardStatsResponse(stats=[
            exec_pb2.BatchSizeStats(model=s.model, batch_size=s.batch_size, count=s.count, median_ms=s.median_ms,
                                    p90_ms=s.p90_ms, p99_ms=s.p99_ms, runtime_mode=s.runtime_mode)
            for s in stats])

    def _model(self, name: str, field: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"{field}: no model named {quote(name)} (loaded: {quote(known)})")
        return served


def _release(served: ServedModel) -> None:
    """Stop the model's engine and give its weights and KV cache back to the device. In a worker thread: the full
    garbage collection held the event loop, and every other model's streams, for ~0.6 s (Llama-3-8B, H200 host)."""
    engine, served.started = served.started.engine, None
    engine.stop()
    del engine  # the last reference: what the collection frees
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def start_exec_server(address: str, compile_address: str | None = None, store_dir: str | Path | None = None,
                            cache_dir: str | Path = DEFAULT_CACHE_DIR, interceptors: Iterable = (),
                            step_observers: Iterable[StepObserver] = (), forward_stats: ForwardStats | None = None,
                            request_spans: RequestSpans | None = None, *, trusted: TrustedKeys,
                            security: ServerSecurity = UNGUARDED, client: ClientSecurity = PLAINTEXT,
                            model_roots: Iterable[str | Path] = ()) -> tuple[Server, int]:
    """Build, bind and start; returns the server and its port (address may say port 0).

    With ``store_dir`` (a store shared with the compile service) bundles are read in place; otherwise they are
    downloaded from the compile service into ``cache_dir`` once and reused; either way only a bundle signed by one
    of ``trusted`` is loaded. ``client`` is how this server calls the compile service (TLS, token). Observers that
    report the forward stats or link to requests share ``forward_stats`` and ``request_spans`` (as a watcher).
    """
    await asyncio.to_thread(bundle.preload_runtime)
    # The fetcher verifies each bundle's signature and sha256s itself: the store only finds them.
    store = FilesystemStore(store_dir if store_dir is not None else cache_dir, verify=False)
    # Instrumented (once init_tracing ran): Compile and GetArtifact carry this trace to the compile service.
    channel = instrumented_channel(compile_address, CHANNEL_OPTIONS, credentials=client.credentials(),
                                   interceptors=client.interceptors()) if compile_address else None
    fetcher = BundleFetcher(store, shared=store_dir is not None, compile_channel=channel, trusted=trusted)
    roots = ModelRoots.for_server(model_roots, loopback=is_loopback(address))
    server = Server([SERVICE_NAME], interceptors, security)
    servicer = ExecServicer(server, fetcher, forward_stats if forward_stats is not None else ForwardStats(),
                            list(step_observers), request_spans if request_spans is not None else RequestSpans(),
                            roots)
    exec_pb2_grpc.add_ExecServiceServicer_to_server(servicer, server.server)
    port = await server.start(address)
    log.info("exec service listening on %s (port %d), compile service %s, %s %s, trusting %s, model roots: %s",
             address, port, compile_address or "none", "shared store" if store_dir is not None else "cache",
             store.root, ", ".join(sorted(trusted.keys)) or "no key", roots.describe())
    return server, port
