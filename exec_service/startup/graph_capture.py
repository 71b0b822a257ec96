"""The capture_cudagraphs phase: piecewise graphs for prefill and mixed steps, full graphs for decode steps, all in
one pool, each measured as it is captured so the KV cache is sized around what they hold.

The piece graphs never read the KV cache (attention runs eagerly between them), so they are captured before it is
allocated, on a scratch cache of a few blocks. The full graphs do read it: the largest is captured once on the
scratch cache to measure its memory (into the same pool, which keeps it for the real ones), and every size is
captured for good once the cache exists. No capture compiles (``expect_no_compile``).

Every rank of a tensor-parallel model runs ``capture_graphs``, the one sequence of captures, at the same sizes in the
same order: the warm-up run before each capture (and each piece graph's replay after it) runs the real all-reduces,
which meet only when every rank runs the same forwards in lockstep. The KV cache's size in between is agreed over
the ranks (``size_kv``).
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
from exec_service.engine.graphs.piecewise_graphs import PiecewiseGraphs
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.model_runner import KVCache
from exec_service.engine.step_inputs import StepBuffers
from kiln.compilation.counters import expect_no_compile
from kiln.errors import ResourceExhausted, first_line
from kiln.model.spec import ResolvedModel
from tracing import spans

OnCaptured = Callable[[int, int], None]  # (size, sizes done)
StepFn = Callable[[str], AbstractContextManager]  # a named step of the phase (load_model's, or none)


@dataclass
class CapturedGraphs:
    full: CUDAGraphs
    piecewise: PiecewiseGraphs | None
    kv: KVCache  # sized around the graphs

    @property
    def captured_bytes(self) -> int:
        return self.full.captured_bytes + (self.piecewise.captured_bytes if self.piecewise else 0)

    @property
    def seconds(self) -> float:
        return self.full.seconds + (self.piecewise.seconds if self.piecewise else 0.0)


@contextmanager
def _no_step(name: str) -> Iterator[None]:
    yield


def _ignore(size: int, done: int) -> None:
    pass


def capture_graphs(forward: ModelForward, config: EngineConfig, resolved: ResolvedModel, buffers: StepBuffers,
                   scratch: tuple[list[torch.Tensor], list[torch.Tensor] | None],
                   size_kv: Callable[[int], KVCache], step: StepFn = _no_step,
                   on_piece: OnCaptured = _ignore, on_full: OnCaptured = _ignore) -> CapturedGraphs:
    """Piece graphs, the full graphs' measure, the KV cache (``size_kv(bytes the graphs hold)``), then the full
    graphs, all in one pool. ``scratch``: a few blocks of cache and their FP8 scales (or None) for the eager
    attention of the captures before the cache exists."""
    scratch_kv, scratch_scales = scratch
    pool = torch.cuda.graph_pool_handle()
    piecewise = None
    if config.piecewise_capture_sizes:
        with step(spans.PIECEWISE_GRAPHS):
            piecewise = capture_piecewise(forward, config, buffers, scratch_kv, pool, on_piece, scratch_scales)
    with step(spans.KV_CACHE):
        kv = size_kv((piecewise.captured_bytes if piecewise else 0)
                     + full_graph_bytes(forward, config, resolved, buffers, scratch_kv, pool, scratch_scales))
    with step(spans.FULL_GRAPHS):
        full = capture_full(forward, config, resolved, buffers, kv.caches, pool, on_full, kv.scales)
    return CapturedGraphs(full, piecewise, kv)


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
