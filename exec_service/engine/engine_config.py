"""How one model is served: LoadModelRequest's limits, validated at the edge with every error naming its field."""

import re
from dataclasses import dataclass, replace

from kiln.errors import InvalidArgument
from kiln.model_spec import ResolvedModel
from protos import exec_pb2

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_CACHE_BYTES = 64 << 20
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_WAITING = 256
MAX_BLOCK_SIZE = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

RUNTIME_MODES = {
    exec_pb2.RUNTIME_MODE_EAGER: "eager",
    exec_pb2.RUNTIME_MODE_COMPILED: "compiled",
    exec_pb2.RUNTIME_MODE_CUDAGRAPH: "cudagraph",
}


@dataclass(frozen=True)
class EngineConfig:
    device: str
    runtime_mode: str  # eager / compiled / cudagraph
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int  # 0 until the bundle's compiled range is known
    block_size: int
    gpu_memory_utilization: float
    kv_cache_bytes: int  # the CPU budget, or a cap on CUDA (0: none)
    capture_sizes: tuple[int, ...]
    max_num_waiting: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @classmethod
    def from_request(cls, request: exec_pb2.LoadModelRequest, model: ResolvedModel, device: str) -> "EngineConfig":
        mode = RUNTIME_MODES.get(request.runtime_mode)
        if request.runtime_mode == exec_pb2.RUNTIME_MODE_UNSPECIFIED:
            mode = "cudagraph" if device == "cuda" else "compiled"
        elif mode is None:
            raise InvalidArgument(f"runtime_mode: unknown value {request.runtime_mode}")
        if mode == "cudagraph" and device != "cuda":
            raise InvalidArgument("runtime_mode: cudagraph needs CUDA; this model runs on cpu")
        positions = getattr(model.config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
        max_model_len = request.max_model_len or min(positions, DEFAULT_MAX_MODEL_LEN)
        if not 2 <= max_model_len <= positions:
            raise InvalidArgument(f"max_model_len: {max_model_len} is outside [2, {positions}] (the model's "
                                  f"max_position_embeddings)")
        max_num_seqs = request.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        if max_num_seqs < 1:
            raise InvalidArgument(f"max_num_seqs: {max_num_seqs} must be positive")
        if request.max_num_batched_tokens < 0:
            raise InvalidArgument(f"max_num_batched_tokens: {request.max_num_batched_tokens} must be positive")
        utilization = request.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        if not 0 < utilization <= 1:
            raise InvalidArgument(f"gpu_memory_utilization: {utilization} is outside (0, 1]")
        if request.kv_cache_bytes < 0:
            raise InvalidArgument(f"kv_cache_bytes: {request.kv_cache_bytes} must not be negative")
        kv_cache_bytes = request.kv_cache_bytes or (DEFAULT_CPU_KV_CACHE_BYTES if device == "cpu" else 0)
        block_size = request.block_size or DEFAULT_BLOCK_SIZE
        if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
            raise InvalidArgument(f"block_size: {block_size} is not a power of two in [1, {MAX_BLOCK_SIZE}]")
        if request.capture_sizes and mode != "cudagraph":
            raise InvalidArgument(f"capture_sizes: given, but runtime_mode is {mode}")
        for size in request.capture_sizes:
            if not 1 <= size <= max_num_seqs:
                raise InvalidArgument(f"capture_sizes: {size} is outside [1, max_num_seqs={max_num_seqs}]")
        capture_sizes = tuple(sorted(set(request.capture_sizes))) if mode == "cudagraph" else ()
        max_num_waiting = request.max_num_waiting or DEFAULT_MAX_NUM_WAITING
        if max_num_waiting < 1:
            raise InvalidArgument(f"max_num_waiting: {max_num_waiting} must be positive")
        return cls(device=device, runtime_mode=mode, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=request.max_num_batched_tokens, block_size=block_size,
                   gpu_memory_utilization=utilization, kv_cache_bytes=kv_cache_bytes, capture_sizes=capture_sizes,
                   max_num_waiting=max_num_waiting)

    def within_token_range(self, compiled_max_tokens: int) -> "EngineConfig":
        """Fill in the step token budget from the compiled range (or check it fits), and default capture sizes."""
        tokens = self.max_num_batched_tokens or compiled_max_tokens
        if tokens > compiled_max_tokens:
            raise InvalidArgument(f"max_num_batched_tokens: {tokens} exceeds the bundle's compiled token range "
                                  f"[1, {compiled_max_tokens}]")
        capture_sizes = self.capture_sizes
        if self.runtime_mode == "cudagraph":
            limit = min(self.max_num_seqs, tokens)
            capture_sizes = capture_sizes or tuple(
                s for s in (1, 2, 4, *range(8, self.max_num_seqs + 1, 8)) if s <= self.max_num_seqs)
            if max(capture_sizes) > limit:
                raise InvalidArgument(f"capture_sizes: {max(capture_sizes)} exceeds max_num_batched_tokens {tokens}")
        return replace(self, max_num_batched_tokens=tokens, capture_sizes=capture_sizes)


def model_name(request: exec_pb2.LoadModelRequest, model: ResolvedModel) -> str:
    name = request.name or model.name
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"name: {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
                              f"letter or digit")
    return name
