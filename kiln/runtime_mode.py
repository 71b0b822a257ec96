"""How a model's forwards run (eager / compiled / cudagraph): one definition, mapped once to the proto enum.

Spans, logs, ``ModelSizing.runtime_mode`` and ``BatchSizeStats.runtime_mode`` carry the value (``"cudagraph"``);
``LoadModelRequest.runtime_mode`` carries the proto enum, converted here and nowhere else.
"""

import enum

from kiln.errors import InvalidArgument
from protos import exec_pb2


class RuntimeMode(enum.StrEnum):
    EAGER = "eager"  # the uncompiled model; nothing is fetched
    COMPILED = "compiled"  # the bundle's compiled function
    CUDAGRAPH = "cudagraph"  # the compiled function, decode steps replayed from CUDA graphs

    @classmethod
    def best_for(cls, device: str) -> "RuntimeMode":
        """What RUNTIME_MODE_UNSPECIFIED means: the fastest the device allows."""
        return cls.CUDAGRAPH if device == "cuda" else cls.COMPILED

    @classmethod
    def from_proto(cls, value: int, device: str) -> "RuntimeMode":
        """The mode a LoadModelRequest asks for on ``device``; INVALID_ARGUMENT for an unknown number."""
        if value == exec_pb2.RUNTIME_MODE_UNSPECIFIED:
            return cls.best_for(device)
        for mode, number in _PROTO.items():
            if number == value:
                return mode
        raise InvalidArgument(f"runtime_mode: unknown value {value}")

    def to_proto(self) -> int:
        return _PROTO[self]


_PROTO = {RuntimeMode.EAGER: exec_pb2.RUNTIME_MODE_EAGER, RuntimeMode.COMPILED: exec_pb2.RUNTIME_MODE_COMPILED,
          RuntimeMode.CUDAGRAPH: exec_pb2.RUNTIME_MODE_CUDAGRAPH}
