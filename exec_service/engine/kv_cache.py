"""The paged KV cache: how many blocks fit in the memory left after the model, and the per-layer tensors.

On CUDA the budget is DESIGN.md's formula, from the eager profile's measured peak:
``total × gpu_memory_utilization − weights − activation peak − CUDA-graph reserve``, capped by ``kv_cache_bytes``.
On CPU there is nothing to measure against: the budget is ``kv_cache_bytes``.
"""

import logging
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from kiln.errors import ResourceExhausted

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class MemoryBudget:
    """What the profile measured and what the KV cache may take."""

    total_bytes: int  # device memory (0 on CPU)
    weights_bytes: int
    activation_peak_bytes: int
    cudagraph_reserve_bytes: int
    kv_cache_bytes: int


def cuda_budget(utilization: float, weights_bytes: int, activation_peak_bytes: int, cudagraph_reserve_bytes: int,
                cap_bytes: int, device: torch.device) -> MemoryBudget:
    free, total = torch.cuda.mem_get_info(device)
    # Memory other processes (and the CUDA context) hold is not ours to plan with.
    others = total - free - torch.cuda.memory_reserved(device)
    kv_bytes = int(total * utilization) - others - weights_bytes - activation_peak_bytes - cudagraph_reserve_bytes
    if cap_bytes:
        kv_bytes = min(kv_bytes, cap_bytes)
    return MemoryBudget(total, weights_bytes, activation_peak_bytes, cudagraph_reserve_bytes, max(kv_bytes, 0))


def cpu_budget(weights_bytes: int, cap_bytes: int) -> MemoryBudget:
    return MemoryBudget(0, weights_bytes, 0, 0, cap_bytes)


def num_blocks(budget: MemoryBudget, spec: KVCacheSpec, max_model_len: int) -> int:
    """Blocks the budget holds. Fewer than one full-length sequence needs is allowed (requests that cannot fit are
    refused one by one), none at all is an error the user can fix."""
    blocks = budget.kv_cache_bytes // spec.block_bytes
    if blocks < 1:
        raise ResourceExhausted(
            f"kv_cache_bytes: {budget.kv_cache_bytes} bytes left for the KV cache hold no block of "
            f"{spec.block_bytes} bytes; raise kv_cache_bytes or gpu_memory_utilization")
    if blocks * spec.block_size < max_model_len:
        log.warning("the KV cache holds %d tokens, fewer than max_model_len %d", blocks * spec.block_size,
                    max_model_len)
    return blocks


def allocate(spec: KVCacheSpec, blocks: int, device: str) -> list[torch.Tensor]:
    """Per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: the layout Kiln's attention op reads."""
    shape = (2, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
