"""How many KV blocks fit in the memory left after the model, from the eager profile's measured peak.

On CUDA the budget is DESIGN.md's formula: ``total × gpu_memory_utilization − weights − activation peak −
CUDA graphs``, capped by ``kv_cache_bytes``, where the graphs' bytes were measured as they were captured
(exec_service.startup.graph_capture). On CPU there is nothing to measure against: the budget is
``kv_cache_bytes``, refused when the host has less memory free. Over the ranks of a tensor-parallel model each rank
sizes its own budget, once the ranks have joined, and the cache gets the fewest blocks any rank's holds (``agree``).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.kv import kv_cache
from exec_service.engine.kv.kv_cache import KVCacheSpec
from exec_service.engine.model_runner import KVCache
from kiln.errors import ResourceExhausted
from kiln.model.device_memory import available_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryBudget:
    """What the profile measured and what the KV cache may take."""

    total_bytes: int  # device memory (0 on CPU)
    weights_bytes: int
    activation_peak_bytes: int
    cudagraph_bytes: int  # measured when the graphs were captured
    kv_cache_bytes: int


def cuda_budget(utilization: float, weights_bytes: int, activation_peak_bytes: int, cudagraph_bytes: int,
                cap_bytes: int, device: torch.device) -> MemoryBudget:
    free, total = torch.cuda.mem_get_info(device)
    # Memory other processes (and the CUDA context) hold is not ours to plan with; the graphs' pool is in what
    # this process reserved, so it is subtracted as measured.
    others = total - free - torch.cuda.memory_reserved(device)
    kv_bytes = int(total * utilization) - others - weights_bytes - activation_peak_bytes - cudagraph_bytes
    if cap_bytes:
        kv_bytes = min(kv_bytes, cap_bytes)
    return MemoryBudget(total, weights_bytes, activation_peak_bytes, cudagraph_bytes, max(kv_bytes, 0))


def cpu_budget(weights_bytes: int, cap_bytes: int) -> MemoryBudget:
    free = available_bytes("cpu")
    if free is not None and cap_bytes > free:
        raise ResourceExhausted(f"kv_cache_bytes: {cap_bytes} bytes asked for the KV cache, this host has {free} "
                                f"bytes of memory free; lower kv_cache_bytes")
    return MemoryBudget(0, weights_bytes, 0, 0, cap_bytes)


def num_blocks(budget: MemoryBudget, spec: KVCacheSpec, max_model_len: int,
               agree: Callable[[int], int] | None = None) -> int:
    """Blocks the budget holds; with ``agree`` (the ranks of a tensor-parallel model), the fewest any rank's holds.
    Fewer than one full-length sequence needs is allowed (requests that cannot fit are refused one by one), none at
    all is an error the user can fix."""
    own = budget.kv_cache_bytes // spec.block_bytes
    blocks = own if agree is None else agree(own)
    if blocks < 1 <= own:
        raise ResourceExhausted(
            f"kv_cache_bytes: another rank's memory left for the KV cache holds no block of {spec.block_bytes} "
            f"bytes (this rank's holds {own}); free memory on that rank's GPU or raise gpu_memory_utilization")
    if blocks < 1:
        graphs = (f" after {budget.cudagraph_bytes} bytes of CUDA graphs (lower piecewise_capture_sizes or "
                  f"capture_sizes)" if budget.cudagraph_bytes else "")
        raise ResourceExhausted(
            f"kv_cache_bytes: {budget.kv_cache_bytes} bytes left for the KV cache{graphs} hold no block of "
            f"{spec.block_bytes} bytes; raise kv_cache_bytes or gpu_memory_utilization")
    if blocks < own:
        log.info("the KV cache has %d blocks, the fewest any rank holds (this rank's holds %d)", blocks, own)
    if blocks * spec.block_size < max_model_len:
        log.warning("the KV cache holds %d tokens, fewer than max_model_len %d", blocks * spec.block_size,
                    max_model_len)
    return blocks


def memory_budget(config: EngineConfig, weights_bytes: int, activation_peak_bytes: int,
                  cudagraph_bytes: int = 0) -> MemoryBudget:
    if config.device == "cuda":
        return cuda_budget(config.gpu_memory_utilization, weights_bytes, activation_peak_bytes, cudagraph_bytes,
                           config.kv_cache_bytes, torch.device("cuda"))
    return cpu_budget(weights_bytes, config.kv_cache_bytes)


def allocate(spec: KVCacheSpec, blocks: int, device: str, kv_window: int, kv_cache_scale: float = 1.0) -> KVCache:
    """A cache of ``blocks`` blocks; with a KV window its last one is the null block (BlockManager). An FP8 cache
    gets its per-layer scales, every head ``kv_cache_scale``."""
    caches = kv_cache.allocate(spec, blocks, device)
    usable = blocks - 1 if kv_window else blocks
    window = f", KV window {kv_window} tokens (+1 null block)" if kv_window else ""
    log.info("# %s blocks: %d%s", "GPU" if device == "cuda" else "CPU", usable, window)
    return KVCache(caches, usable, kv_window, kv_cache.allocate_scales(spec, kv_cache_scale, device))


def allocate_budgeted(config: EngineConfig, weights_bytes: int, activation_peak_bytes: int, spec: KVCacheSpec,
                      kv_window: int, cudagraph_bytes: int = 0, agree: Callable[[int], int] | None = None) -> KVCache:
    """The cache ``memory_budget`` leaves room for (``agree``: as ``num_blocks``)."""
    budget = memory_budget(config, weights_bytes, activation_peak_bytes, cudagraph_bytes)
    return allocate(spec, num_blocks(budget, spec, config.max_model_len, agree), config.device, kv_window,
                    config.kv_cache_scale)
