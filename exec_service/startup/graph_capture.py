"""The capture_cudagraphs phase: mixed graphs for prefill and mixed steps, decode graphs for decode steps, all in one
pool, measured before the KV cache is sized so the cache is sized around what they hold.

Both kinds read the KV cache (attention is inside them), so the largest of each is first captured on a scratch cache
of a few blocks to measure its memory (into the same pool, which keeps it for the real ones), and every size is
captured for good once the cache exists. No capture compiles (``expect_no_compile``).

Every rank of a tensor-parallel model runs ``capture_graphs``, the one sequence of captures, at the same sizes in the
same order: the warm-up run before each kind's first capture, and every capture, run the real all-reduces, which
meet only when every rank runs the same forwards in lockstep. The KV cache's size in between is agreed over the ranks
(``size_kv``).
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
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
    full: CUDAGraphs  # decode graphs, by batch size
    mixed: CUDAGraphs | None  # mixed graphs, by token count
    kv: KVCache  # sized around the graphs
    measured: tuple[int, int]  # the pool's growth for the largest decode and mixed graph, before the cache

    @property
    def mixed_bytes(self) -> int:
        """Device memory of the mixed graphs: their measure and what capturing them all added."""
        return self.measured[1] + (self.mixed.captured_bytes if self.mixed else 0)

    @property
    def captured_bytes(self) -> int:
        """Device memory of every graph: both measures and what the captures for good added to the pool."""
        return self.measured[0] + self.full.captured_bytes + self.mixed_bytes

    @property
    def seconds(self) -> float:
        return self.full.seconds + (self.mixed.seconds if self.mixed else 0.0)


@contextmanager
def _no_step(name: str) -> Iterator[None]:
    yield


def _ignore(size: int, done: int) -> None:
    pass


# (what the error names, what ran out) of each kind of graph
_DECODE = ("capture_sizes", "decode CUDA graphs")
_MIXED = ("piecewise_capture_sizes", "mixed CUDA graphs")


def capture_graphs(forward: ModelForward, config: EngineConfig, resolved: ResolvedModel, buffers: StepBuffers,
                   scratch: tuple[list[torch.Tensor], list[torch.Tensor] | None],
                   size_kv: Callable[[int], KVCache], step: StepFn = _no_step,
                   on_mixed: OnCaptured = _ignore, on_full: OnCaptured = _ignore) -> CapturedGraphs:
    """The graphs' measure, the KV cache (``size_kv(bytes the graphs hold)``), then the mixed and the decode
    graphs, all in one pool. ``scratch``: a few blocks of cache and their FP8 scales (or None) for the measure's
    captures, before the cache exists."""
    scratch_kv, scratch_scales = scratch
    pool = torch.cuda.graph_pool_handle()
    mixed_sizes = config.piecewise_capture_sizes
    with step(spans.KV_CACHE):
        # Both measures held until the cache is sized: the second cannot reuse the first's memory, so the sum bounds
        # what both kinds hold in the pool.
        probes = [decode_graphs(forward, (max(config.capture_sizes),), resolved, buffers, pool)]
        if mixed_sizes:
            probes.append(mixed_graphs(forward, (max(mixed_sizes),), resolved, buffers, pool))
        for probe, kind in zip(probes, (_DECODE, _MIXED), strict=False):
            _capture(probe, kind, scratch_kv, scratch_scales)
        measured = (probes[0].captured_bytes, probes[1].captured_bytes if mixed_sizes else 0)
        kv = size_kv(sum(measured))
        del probes
    mixed = None
    if mixed_sizes:
        with step(spans.MIXED_GRAPHS):
            mixed = mixed_graphs(forward, mixed_sizes, resolved, buffers, pool)
            _capture(mixed, _MIXED, kv.caches, kv.scales, on_mixed)
    with step(spans.FULL_GRAPHS):
        full = decode_graphs(forward, config.capture_sizes, resolved, buffers, pool)
        _capture(full, _DECODE, kv.caches, kv.scales, on_full)
    return CapturedGraphs(full, mixed, kv, measured)


@torch.no_grad()
def _capture(graphs: CUDAGraphs, kind: tuple[str, str], kv_caches: list[torch.Tensor],
             kv_scales: list[torch.Tensor] | None, on_captured: OnCaptured = _ignore) -> None:
    field, what = kind
    try:
        with expect_no_compile(f"{what} capture"):
            graphs.capture(kv_caches, on_captured, kv_scales)
    except torch.OutOfMemoryError as exc:
        raise ResourceExhausted(f"{field}: capturing {what} ran out of device memory ({first_line(exc)}); lower "
                                f"{field} or gpu_memory_utilization") from exc


def decode_graphs(forward: ModelForward, sizes: tuple[int, ...], resolved: ResolvedModel, buffers: StepBuffers,
                  pool) -> CUDAGraphs:
    return CUDAGraphs(forward.compiled_forward, sizes, buffers, buffers.graph_metadata, resolved.config.hidden_size,
                      resolved.dtype, torch.device("cuda"), pool)


def mixed_graphs(forward: ModelForward, sizes: tuple[int, ...], resolved: ResolvedModel, buffers: StepBuffers,
                 pool) -> CUDAGraphs:
    return CUDAGraphs(forward.compiled_forward, sizes, buffers, buffers.mixed_graph_metadata,
                      resolved.config.hidden_size, resolved.dtype, torch.device("cuda"), pool)
