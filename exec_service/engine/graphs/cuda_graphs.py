"""Full CUDA graphs of whole steps, one per capture size, captured largest first into the model's graph pool.

Two kinds, each a ``CUDAGraphs``: decode graphs, one per batch size, which a decode-only step of n sequences replays
at the smallest captured size >= n; and mixed graphs, one per token count (``piecewise_capture_sizes``), which a
prefill or mixed step of T tokens replays at the smallest captured count >= T. The graphs read the model's step
buffers (``StepBuffers``), which every step fills in place, so a replay copies nothing: padding tokens have slot -1
(the KV write skips them), padding sequence rows an empty context (attention passes them by), and the first rows of
the static output are the step's hidden states. The attention kernels read lengths, query offsets and block tables
on the device and launch grids that depend on the captured size only (a mixed graph launches the decode and the
prefill kernels over every row, each taking the rows its query length selects), so one capture serves every step
that fits it. CUDA only: on CPU the runner calls the compiled function directly.
"""

import time
from collections.abc import Callable

import torch

from exec_service.engine.step_inputs import StepBuffers
from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids [T], positions [T]) -> hidden [T, H]


class CUDAGraphs:
    def __init__(self, forward: Forward, capture_sizes: tuple[int, ...], buffers: StepBuffers,
                 metadata_of: Callable[[int], AttentionMetadata], hidden_size: int, dtype: torch.dtype,
                 device: torch.device, pool=None):
        """``capture_sizes`` count what a step is padded by (sequences of a decode graph, tokens of a mixed graph);
        ``metadata_of(size)``: the buffers' views a graph of that size is captured reading."""
        self.forward = forward
        self.capture_sizes = tuple(sorted(capture_sizes))
        self.buffers = buffers
        self.metadata_of = metadata_of
        self.hidden = torch.zeros(self.capture_sizes[-1], hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool  # a torch.cuda.graph_pool_handle() shared by both kinds, or None: its own
        self.captured_bytes = 0
        self.seconds = 0.0

    def capture(self, kv_caches: list[torch.Tensor], on_captured: Callable[[int, int], None] = lambda *_: None,
                kv_scales: list[torch.Tensor] | None = None) -> float:
        """Capture every size, largest first so the smaller graphs fit in the pool the largest allocated.

        ``on_captured(size, done)`` reports progress after each size. Returns the seconds it took;
        ``captured_bytes`` is the device memory the graphs hold.
        """
        start = time.perf_counter()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        input_ids, positions = self.buffers.input_ids, self.buffers.positions
        for size in reversed(self.capture_sizes):
            with forward_context(ForwardContext(kv_caches, self.metadata_of(size), kv_scales)):
                if not self.graphs:
                    # One eager run before the first capture only (as vLLM captures with no warm-up of its own): the
                    # kernels are loaded and tuned by then, and no size builds a variant of its own.
                    self.hidden[:size] = self.forward(input_ids[:size], positions[:size])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:size] = self.forward(input_ids[:size], positions[:size])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize()
            on_captured(size, len(self.graphs))
        free_after, _ = torch.cuda.mem_get_info()
        self.captured_bytes = max(0, free_before - free_after)
        self.seconds = time.perf_counter() - start
        return self.seconds

    def padded_size(self, count: int) -> int | None:
        """The captured size a step of ``count`` (sequences or tokens) replays, or None when it is over the largest."""
        if count > self.capture_sizes[-1]:
            return None
        return next(size for size in self.capture_sizes if size >= count)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size`` on what the step buffers hold; its hidden states, padding included."""
        self.graphs[size].replay()
        return self.hidden[:size]
