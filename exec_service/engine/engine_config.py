"""How one model is served: the limits of its engine, checked at the API edge (exec_service.api.load_request)."""

from dataclasses import dataclass, replace

from kiln.errors import InvalidArgument
from kiln.runtime_mode import RuntimeMode


@dataclass(frozen=True)
class EngineConfig:
    device: str
    runtime_mode: RuntimeMode
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int  # 0 until the bundle's compiled range is known
    block_size: int
    gpu_memory_utilization: float
    kv_cache_bytes: int  # the CPU budget, or a cap on CUDA (0: none)
    capture_sizes: tuple[int, ...]
    max_num_waiting: int
    quantization: str = ""  # the compile config's: "fp8" makes the decoder's linears FP8 at load
    kv_cache_dtype: str = ""  # "fp8_e4m3", or empty: the model's dtype (exec_service.engine.kv_cache)
    kv_cache_scale: float = 1.0  # an FP8 cache's scale, every layer and head
    enable_prefix_caching: bool = True  # full KV blocks known by content and reused by later prompts

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def within_token_range(self, compiled_max_tokens: int) -> "EngineConfig":
        """Fill in the step token budget from the compiled range (or check it fits), and default capture sizes."""
        tokens = self.max_num_batched_tokens or compiled_max_tokens
        if tokens > compiled_max_tokens:
            raise InvalidArgument(f"max_num_batched_tokens: {tokens} exceeds the bundle's compiled token range "
                                  f"[1, {compiled_max_tokens}]")
        capture_sizes = self.capture_sizes
        if self.runtime_mode == RuntimeMode.CUDAGRAPH:
            limit = min(self.max_num_seqs, tokens)
            capture_sizes = capture_sizes or tuple(
                s for s in (1, 2, 4, *range(8, self.max_num_seqs + 1, 8)) if s <= self.max_num_seqs)
            if max(capture_sizes) > limit:
                raise InvalidArgument(f"capture_sizes: {max(capture_sizes)} exceeds max_num_batched_tokens {tokens}")
        return replace(self, max_num_batched_tokens=tokens, capture_sizes=capture_sizes)
