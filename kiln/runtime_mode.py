"""How a model's forwards run (eager / compiled / cudagraph): one definition, shared by the engine, spans and logs.

Spans, logs, ``ModelSizing.runtime_mode`` and ``BatchSizeStats.runtime_mode`` carry the value (``"cudagraph"``);
the proto enum of ``LoadModelRequest.runtime_mode`` is converted at the API edge (exec_service/api/runtime_modes.py).
"""

import enum


class RuntimeMode(enum.StrEnum):
    EAGER = "eager"  # the uncompiled model; nothing is fetched
    COMPILED = "compiled"  # the bundle's compiled function
    CUDAGRAPH = "cudagraph"  # the compiled function, decode steps replayed from CUDA graphs

    @classmethod
    def best_for(cls, device: str) -> "RuntimeMode":
        """What RUNTIME_MODE_UNSPECIFIED means: the fastest the device allows."""
        return cls.CUDAGRAPH if device == "cuda" else cls.COMPILED
