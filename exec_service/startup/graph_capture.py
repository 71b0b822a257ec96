"""The capture_cudagraphs phase: piecewise graphs for prefill and mixed steps, full graphs for decode steps, all in
one pool, each measured as it is captured so the KV cache is sized around what they hold.

The piece graphs never read the KV cache (attention runs eagerly between them), so they are captured before it is
allocated, on a scratch cache of a few blocks. The full graphs do read it: the largest is captured once on the
scratch cache to measure its memory (into the same pool, which keeps it for the real ones), and every size is
captured for good once the cache exists. No capture compiles (``expect_no_compile``).
"""

from collections.abc import Callable

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
from exec_service.engine.graphs.piecewise_graphs import PiecewiseGraphs
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.step_inputs import StepBuffers
from kiln.compilation.counters import expect_no_compile
from kiln.errors import ResourceExhausted, first_line
from kiln.model.spec import ResolvedModel

OnCaptured = Callable[[int, int], None]  # (size, sizes done)


def _out_of_memory(exc: torch.OutOfMemoryError, field: str, what: str) -> ResourceExhausted:
    return ResourceExhausted(f"{field}: capturing {what} ran out of device memory ({first_line(exc)}); lower "
                             f"{field} or gpu_memory_utilization")


@torch.no_grad()
def capture_piecewise(forward: ModelForward, config: EngineConfig, buffers: StepBuffers,
                      scratch_kv: list[torch.Tensor], pool, on_captured: OnCaptured,
                      scratch_scales: list[torch.Tensor] | None = None) -> PiecewiseGraphs:
    persistent = [*forward.token_model.parameters(), *forward.token_model.buffers()]
    graphs = PiecewiseGraphs(forward.compiled_forward, config.piecewise_capture_sizes, buffers, persistent, pool)
    try:
        with expect_no_compile("piecewise CUDA-graph capture"):
            graphs.capture(scratch_kv, on_captured, scratch_scales)
    except torch.OutOfMemoryError as exc:
        raise _out_of_memory(exc, "piecewise_capture_sizes", "piecewise CUDA graphs") from exc
    return graphs


@torch.no_grad()
def full_graph_bytes(forward: ModelForward, config: EngineConfig, resolved: ResolvedModel, buffers: StepBuffers,
                     scratch_kv: list[torch.Tensor], pool, scratch_scales: list[torch.Tensor] | None = None) -> int:
    """Device memory the full graphs will take: the largest captured on the scratch cache, then let go."""
    probe = _full_graphs(forward, (max(config.capture_sizes),), resolved, buffers, pool)
    try:
        with expect_no_compile("CUDA-graph capture"):
            probe.capture(scratch_kv, kv_scales=scratch_scales)
    except torch.OutOfMemoryError as exc:
        raise _out_of_memory(exc, "capture_sizes", "full CUDA graphs") from exc
    return probe.captured_bytes


@torch.no_grad()
def capture_full(forward: ModelForward, config: EngineConfig, resolved: ResolvedModel, buffers: StepBuffers,
                 kv_caches: list[torch.Tensor], pool, on_captured: OnCaptured,
                 kv_scales: list[torch.Tensor] | None = None) -> CUDAGraphs:
    graphs = _full_graphs(forward, config.capture_sizes, resolved, buffers, pool)
    try:
        with expect_no_compile("CUDA-graph capture"):
            graphs.capture(kv_caches, on_captured, kv_scales)
    except torch.OutOfMemoryError as exc:
        raise _out_of_memory(exc, "capture_sizes", "full CUDA graphs") from exc
    return graphs


def _full_graphs(forward: ModelForward, sizes: tuple[int, ...], resolved: ResolvedModel, buffers: StepBuffers,
                 pool) -> CUDAGraphs:
    return CUDAGraphs(forward.compiled_forward, sizes, buffers, resolved.config.hidden_size, resolved.dtype,
                      torch.device("cuda"), pool)
