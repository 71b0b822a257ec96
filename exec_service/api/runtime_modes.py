"""``LoadModelRequest.runtime_mode``, the proto enum, to and from kiln.runtime_mode.RuntimeMode: here and nowhere else,
so the engine below the API edge knows the Python enum only."""

from kiln.errors import InvalidArgument
from kiln.runtime_mode import RuntimeMode
from protos import exec_pb2

_PROTO = {RuntimeMode.EAGER: exec_pb2.RUNTIME_MODE_EAGER, RuntimeMode.COMPILED: exec_pb2.RUNTIME_MODE_COMPILED,
          RuntimeMode.CUDAGRAPH: exec_pb2.RUNTIME_MODE_CUDAGRAPH}


def runtime_mode_from_proto(value: int, device: str) -> RuntimeMode:
    """The mode a LoadModelRequest asks for on ``device``; INVALID_ARGUMENT for an unknown number."""
    if value == exec_pb2.RUNTIME_MODE_UNSPECIFIED:
        return RuntimeMode.best_for(device)
    for mode, number in _PROTO.items():
        if number == value:
            return mode
    raise InvalidArgument(f"runtime_mode: unknown value {value}")


def runtime_mode_to_proto(mode: RuntimeMode | None) -> int:
    """The enum number for ``mode``; None (the client asked for nothing) is RUNTIME_MODE_UNSPECIFIED."""
    return exec_pb2.RUNTIME_MODE_UNSPECIFIED if mode is None else _PROTO[mode]
