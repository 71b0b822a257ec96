"""ExecService over gRPC: LoadModel (streamed phases), UnloadModel, ListModels, Generate (streamed), GetForwardStats.

Every model's readiness is in the health service under ``kiln.v1.ExecService/<model name>``: NOT_SERVING while
it loads or after a failed load, SERVING once it is ready, NOT_FOUND once unloaded (as for a name never loaded).
At shutdown, requests still running when the grace ends are ended with UNAVAILABLE, saying why.
"""

import asyncio
import gc
import logging
import time

import torch

from exec_service.api import messages
from exec_service.api.load_request import load_target
from exec_service.api.sequence_output import SequenceOutput
from exec_service.api.served_model import ServedModel
from exec_service.startup.fetch import BundleFetcher
from exec_service.startup.load_model import LoadTarget, StartedModel, start_model
from exec_service.telemetry.exec_telemetry import ExecTelemetry
from kiln.errors import AlreadyExists, FailedPrecondition, KilnError, NotFound, Unavailable, first_line, quote
from kiln.model.roots import ModelRoots
from kiln.rpc.grpc_server import ProgressEvents, Server, in_worker_thread, status_errors
from protos import exec_pb2, exec_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = exec_pb2.DESCRIPTOR.services_by_name["ExecService"].full_name


def health_name(model: str) -> str:
    return f"{SERVICE_NAME}/{model}"


class ExecServicer(exec_pb2_grpc.ExecServiceServicer):
    def __init__(self, server: Server, fetcher: BundleFetcher, telemetry: ExecTelemetry, roots: ModelRoots):
        self.server = server
        self.fetcher = fetcher
        self.roots = roots  # the only directories a request may name (model, weights)
        self.telemetry = telemetry  # its step observers go to every engine; its request spans track each Generate
        self.models: dict[str, ServedModel] = {}

    @status_errors
    async def LoadModel(self, request, context):
        served, target = await self._begin_load(request)
        progress = ProgressEvents()
        remaining = context.time_remaining()  # the client's deadline bounds the calls to the compile service
        deadline = None if remaining is None else time.monotonic() + remaining
        # A task of its own: the load completes (or fails) and updates the model even if this client goes away. Task
        # and thread run in copies of this context, so the startup spans are children of this call's server span.
        load = asyncio.ensure_future(self._load(served, target, progress.emit, deadline))
        async for phase in progress.until_done(load):
            yield exec_pb2.LoadModelEvent(phase=messages.startup_phase_message(phase))
        yield exec_pb2.LoadModelEvent(ready=messages.model_sizing_message(load.result().sizing))

    async def preload(self, request: exec_pb2.LoadModelRequest) -> asyncio.Task:
        """A LoadModel the operator asked for at start (``--load``), in the background: its phases go to the log,
        and its health entry turns SERVING once it is ready, which is what a per-model readiness probe waits for."""
        served, target = await self._begin_load(request)
        task = asyncio.ensure_future(self._load(served, target, lambda phase: None))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is logged and in ListModels
        return task

    async def _begin_load(self, request: exec_pb2.LoadModelRequest) -> tuple[ServedModel, LoadTarget]:
        target = load_target(request, self.roots)
        previous = self.models.get(target.name)
        if previous is not None and previous.state != exec_pb2.MODEL_STATE_FAILED:
            raise AlreadyExists(f"name: a model named {quote(target.name)} is already loaded or loading; unload it "
                                f"or choose another name")
        served = self.models[target.name] = ServedModel(target.name)
        await self.server.set_serving(health_name(target.name), False)
        return served, target

    async def _load(self, served: ServedModel, target: LoadTarget, emit, deadline: float | None = None
                    ) -> StartedModel:
        try:
            started = await in_worker_thread(start_model, target, self.fetcher, self.telemetry.step_observers, emit,
                                             deadline)
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
        await self.server.forget(health_name(request.name))
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
        seqs, stop = served.new_sequences(request)
        first, *others = seqs
        with self.telemetry.request_spans.track(served.name, first):
            stream = engine.add_request(first, others)
            outputs = [SequenceOutput(seq, served.started.tokenizer, stop) for seq in seqs]
            live = len(outputs)
            try:
                async for output in stream:
                    if output.error is not None:
                        raise output.error
                    sequence = outputs[output.index]
                    if sequence.done:  # a stop string ended it; the engine's tokens after it are dropped
                        continue
                    response = sequence.response(output)
                    if sequence.stopped:
                        engine.end_sequence(sequence.seq)
                    live -= sequence.done
                    yield response
                    if not live:
                        break
            finally:
                if live:  # cancelled, deadline passed, or the client went away: free the blocks now
                    engine.abort(first.request_id)

    @status_errors
    async def GetForwardStats(self, request, context):
        stats = self.telemetry.forward_stats.snapshot(request.model or None, request.reset)
        if request.model and not stats and request.model not in self.models:
            raise NotFound(f"model: no model named {quote(request.model)}")
        return messages.forward_stats_response(stats)

    async def end_streams(self, grace: float) -> None:
        """The shutdown grace has ended: end every request still running or waiting with UNAVAILABLE, so its
        client knows to retry elsewhere (and has every token sent so far)."""
        error = Unavailable(f"model: the exec service is shutting down and this request did not finish within its "
                            f"shutdown grace of {grace:.0f} s; retry it on another replica")
        engines = [m.started.engine for m in self.models.values() if m.started is not None]
        log.warning("shutdown grace over: ending the requests of %d models with UNAVAILABLE", len(engines))
        await asyncio.gather(*(asyncio.to_thread(engine.stop, error) for engine in engines))

    def _model(self, name: str, field: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"{field}: no model named {quote(name)} (loaded: {quote(known)})")
        return served


def _release(served: ServedModel) -> None:
    """Stop the model's engine and give its weights and KV cache back to the device. In a worker thread: the full
    garbage collection of a large model held the event loop, and every other model's streams, for a noticeable
    pause (BENCHMARKS.md, the py-spy profile)."""
    engine, served.started = served.started.engine, None
    engine.stop()
    del engine  # the last reference: what the collection frees
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
