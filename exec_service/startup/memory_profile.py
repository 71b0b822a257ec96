"""The memory profile: one forward of the eager model at the step's largest size, before anything is compiled.

vLLM's "not compile for profiling": the profile runs on the eager model *before* the compiled function is loaded,
and must not run Dynamo or Inductor (``expect_no_compile`` raises if the counters move). Its peak is what the KV
cache sizing (kv_sizing) leaves room for.
"""

import logging
import time

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.sampler import SamplingTensors, sample
from kiln.compilation.counters import expect_no_compile
from kiln.model.causal_lm import TokenModel

log = logging.getLogger(__name__)

@torch.no_grad()
def profile_memory(token_model: TokenModel, config: EngineConfig) -> int:
    """One forward at max_num_batched_tokens on the eager model plus a sampler pass at max_num_seqs rows.

    Returns the activation peak in bytes (CUDA; 0 on CPU, where the KV cache comes from a byte budget). There is
    no forward context, so attention is the plain causal reference over all tokens: no less memory than the paged
    kernels need.
    """
    start = time.perf_counter()
    tokens = config.max_num_batched_tokens
    device = config.device
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    with expect_no_compile("the memory profile"):
        hidden = token_model(torch.zeros(tokens, dtype=torch.int64, device=device), torch.arange(tokens, device=device))
        rows = min(config.max_num_seqs, tokens)
        sample(token_model.logits(hidden[:rows]), _profile_sampling(rows, device))
        token_model.logits(hidden[:1])  # an FP8 head's kernels at a decode's few rows: their variants built here
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
    del hidden
    log.info("Memory profiling took %.2f seconds", time.perf_counter() - start)
    return peak


def _profile_sampling(rows: int, device: str) -> SamplingTensors:
    """Every row sampled with top-k and top-p: the sort behind them, and the noise, are the sampler's memory peak."""
    def column(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=device)

    return SamplingTensors(temperature=column(1.0, torch.float32), top_k=column(50, torch.int64),
                           top_p=column(0.9, torch.float32), seeds=column(0, torch.int64),
                           positions=column(1, torch.int64), all_greedy=False, any_top_k_top_p=True)
