"""How one model is served: the limits of its engine, checked at the API edge (exec_service.api.load_request)."""

from dataclasses import dataclass

from kiln.runtime_mode import RuntimeMode

# Token counts of the mixed CUDA graphs when LoadModel names none (those up to the step token budget): dense
# where steps are short, 64 apart towards 512, where a padded token costs more. Not 448: cuBLAS runs Llama-3-8B's
# gate/up GEMM of 448 rows 1.6x slower than 512 rows on the H200, so a step padded to 448 took 17 ms where one
# padded to 512 takes 14 (BENCHMARKS.md, "Prefill and mixed steps").
DEFAULT_PIECEWISE_CAPTURE_SIZES = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


@dataclass(frozen=True)
class EngineConfig:
    device: str
    runtime_mode: RuntimeMode
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int  # the scheduler's step budget, within the bundle's compiled token range
    block_size: int
    gpu_memory_utilization: float
    kv_cache_bytes: int  # the CPU budget, or a cap on CUDA (0: none)
    capture_sizes: tuple[int, ...]  # full graphs: decode batch sizes
    max_num_waiting: int
    quantization: str = ""  # the compile config's: "fp8" makes the decoder's linears FP8 at load
    quantize_head: bool = False  # LoadModelRequest.quantize_head: with fp8, the head too
    kv_cache_dtype: str = ""  # "fp8_e4m3", or empty: the model's dtype (exec_service.engine.kv.kv_cache)
    kv_cache_scale: float = 1.0  # an FP8 cache's scale, every layer and head
    enable_prefix_caching: bool = True  # full KV blocks known by content and reused by later prompts
    # Mixed graphs: token counts of prefill and mixed steps, () for none (complete: defaults filled in at the edge).
    piecewise_capture_sizes: tuple[int, ...] = ()
    tensor_parallel_size: int = 1  # ranks, one process each; rank 0 (this process) schedules
    stream_interval: int = 1  # tokens a stream sends at a time after its first (exec_service.engine.engine_loop)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
