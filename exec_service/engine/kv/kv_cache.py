"""The paged KV cache's layout: bytes per block, and the per-layer tensors the attention op reads and writes.

How many blocks fit is decided at startup (exec_service.startup.kv_sizing). An FP8 cache (``kv_cache_dtype``
fp8_e4m3) takes one byte an element, so twice the blocks of bfloat16 fit; each layer has a scale per kv head for its
keys and for its values, that the attention op divides by on write and multiplies by on read (docs/fp8.md).
"""

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# kv_cache_dtype -> what the cache stores; empty is the model's dtype. "fp8" is vLLM's name for the same.
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES[kv_cache_dtype] if kv_cache_dtype else model_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: PretrainedConfig, block_size: int, dtype: torch.dtype,
                    tensor_parallel_size: int = 1) -> "KVCacheSpec":
        """One rank's cache: its share of the KV heads (kiln.model.tensor_parallel divides them evenly)."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads // tensor_parallel_size, head_dim, block_size, dtype)

    @property
    def block_bytes(self) -> int:
        """Keys and values of ``block_size`` tokens in every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


def allocate(spec: KVCacheSpec, blocks: int, device: str) -> list[torch.Tensor]:
    """Per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: the layout Kiln's attention op reads."""
    shape = (2, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def allocate_scales(spec: KVCacheSpec, scale: float, device: str) -> list[torch.Tensor] | None:
    """Per layer of an FP8 cache ``[2, num_kv_heads]`` float32 (keys', values'), every head ``scale``; None for a
    cache in the model's dtype. Per-head values may differ: the attention op reads one per kv head."""
    if spec.dtype != torch.float8_e4m3fn:
        return None
    return [torch.full((2, spec.num_kv_heads), scale, dtype=torch.float32, device=device)
            for _ in range(spec.num_layers)]
