"""The load_weights phase: the model built on its device with its weights, and what they decide for the KV cache."""

from dataclasses import dataclass

from exec_service.engine.engine_config import EngineConfig
from kiln.attention.windows import kv_window, layer_windows
from kiln.model.causal_lm import TokenModel, build_model, weights_bytes
from kiln.model.spec import ResolvedModel
from kiln.model.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class LoadedWeights:
    token_model: TokenModel
    weights_bytes: int
    kv_window: int  # kiln.attention.windows.kv_window of the model; 0 when no sequence outgrows it by a block
    quantization: str  # "fp8" when the decoder's linears are FP8 (asked for, or the checkpoint's), else ""


def load_weights(resolved: ResolvedModel, config: EngineConfig, weights: str, seed: int,
                 rank: int = 0) -> LoadedWeights:
    """``rank``'s shard of the model (the execute service's own process is rank 0)."""
    token_model = build_model(resolved, config.device, weights, seed, config.quantization,
                              TensorParallel(rank, config.tensor_parallel_size), config.quantize_head)
    window = kv_window(layer_windows(token_model, config.device))
    # A window that no sequence outgrows by a whole block never lets one go: then there is no null block either.
    window = window if window + config.block_size <= config.max_model_len else 0
    return LoadedWeights(token_model, weights_bytes(token_model), window, "fp8" if token_model.is_fp8 else "")
