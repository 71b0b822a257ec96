"""The paged KV cache's layout: bytes per block, and the per-layer tensors the attention op reads and writes.

How many blocks fit is decided at startup (exec_service.startup.kv_sizing).
"""

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)

    @property
    def block_bytes(self) -> int:
        """Keys and values of ``block_size`` tokens in every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


def allocate(spec: KVCacheSpec, blocks: int, device: str) -> list[torch.Tensor]:
    """Per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: the layout Kiln's attention op reads."""
    shape = (2, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
