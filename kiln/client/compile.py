"""Compile on a compile service: the progress as it streams, the result at the end."""

from collections.abc import Callable

from kiln.client.streams import StreamIncomplete
from protos import compile_pb2

ProgressFn = Callable[[compile_pb2.CompileProgress], None]


def _ignore(progress: compile_pb2.CompileProgress) -> None:
    pass


def compile_model(stub, request: compile_pb2.CompileRequest, on_progress: ProgressFn = _ignore,
                  timeout: float | None = None) -> compile_pb2.CompileResult:
    """Compile to the stream's end, each progress event to ``on_progress``; the result (a hit or a compile)."""
    result = None
    for event in stub.Compile(request, timeout=timeout):
        if event.HasField("result"):
            result = event.result
        else:
            on_progress(event.progress)
    if result is None:
        raise StreamIncomplete("the Compile stream ended without a result")
    return result


async def compile_model_async(stub, request: compile_pb2.CompileRequest,
                              on_progress: ProgressFn = _ignore) -> compile_pb2.CompileResult:
    """compile_model on a grpc.aio stub."""
    result = None
    async for event in stub.Compile(request):
        if event.HasField("result"):
            result = event.result
        else:
            on_progress(event.progress)
    if result is None:
        raise StreamIncomplete("the Compile stream ended without a result")
    return result
