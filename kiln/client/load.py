"""LoadModel on an execute service: each startup phase as it streams, the ready model's sizing at the end.

The stream is read to its end, past ``ready``, so the call (and its client span) ends inside the caller's span
rather than when an abandoned stream is collected.
"""

from collections.abc import Callable

from kiln.client.streams import StreamIncomplete
from protos import exec_pb2

PhaseFn = Callable[[exec_pb2.StartupPhase], None]


def _ignore(phase: exec_pb2.StartupPhase) -> None:
    pass


def load(stub, request: exec_pb2.LoadModelRequest, on_phase: PhaseFn = _ignore,
         timeout: float | None = None) -> exec_pb2.ModelSizing:
    """LoadModel, each phase (and progress inside one) to ``on_phase``; the sizing of the ready model."""
    sizing = None
    for event in stub.LoadModel(request, timeout=timeout):
        sizing = _take(event, on_phase) or sizing
    return _ready(sizing)


async def load_async(stub, request: exec_pb2.LoadModelRequest, on_phase: PhaseFn = _ignore,
                     timeout: float | None = None) -> exec_pb2.ModelSizing:
    """load on a grpc.aio stub."""
    sizing = None
    async for event in stub.LoadModel(request, timeout=timeout):
        sizing = _take(event, on_phase) or sizing
    return _ready(sizing)


def _take(event: exec_pb2.LoadModelEvent, on_phase: PhaseFn) -> exec_pb2.ModelSizing | None:
    if event.HasField("ready"):
        return event.ready
    on_phase(event.phase)
    return None


def _ready(sizing: exec_pb2.ModelSizing | None) -> exec_pb2.ModelSizing:
    if sizing is None:
        raise StreamIncomplete("the LoadModel stream ended before the model was ready")
    return sizing


def phase_line(phase: exec_pb2.StartupPhase) -> str:
    """A phase as one line: its seconds, name and detail; progress inside a phase indented under it."""
    if phase.progress:
        return f"           {phase.phase:<20} {phase.detail}"
    return f"  {phase.seconds:7.2f}s  {phase.phase:<20} {phase.detail}"


def ready_line(sizing: exec_pb2.ModelSizing) -> str:
    """The ready model in one line: its KV cache, limits, runtime and bundle."""
    return (f"ready: {sizing.num_kv_blocks} KV blocks of {sizing.block_size} tokens "
            f"({sizing.kv_cache_bytes / 2**20:.1f} MiB), max_num_seqs {sizing.max_num_seqs}, max_model_len "
            f"{sizing.max_model_len}, max_num_batched_tokens {sizing.max_num_batched_tokens}, {sizing.dtype} "
            f"{sizing.runtime_mode} on {sizing.device}, prefix caching {'on' if sizing.prefix_caching else 'off'}, "
            f"{_stream_interval(sizing.stream_interval)}bundle {sizing.key.digest[:16] or '-'}")


def _stream_interval(tokens: int) -> str:
    return f"streams {tokens} tokens a message, " if tokens > 1 else ""
