"""Full CUDA graphs for decode steps: one per capture size, captured largest first into the model's graph pool.

A decode-only step of n sequences replays the graph of the smallest captured size >= n. The graphs read the model's
step buffers (``StepBuffers``), which every step fills in place, so a replay copies nothing: the padding rows have
slot -1 (the KV write skips them) and sequence length 0 (attention returns zeros for them), and the first n rows of
the static output are the step's hidden states. The attention kernels read lengths and block tables on the device,
so one capture serves every context length. Prefill and mixed steps replay piecewise graphs instead
(piecewise_graphs.py), from the same pool. CUDA only: on CPU the runner calls the compiled function directly.
"""

import time
from collections.abc import Callable

import torch

from exec_service.engine.step_inputs import StepBuffers
from kiln.attention.forward_context import ForwardContext, forward_context

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids [T], positions [T]) -> hidden [T, H]


class CUDAGraphs:
    def __init__(self, forward: Forward, capture_sizes: tuple[int, ...], buffers: StepBuffers, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, pool=None):
        self.forward = forward
        self.capture_sizes = tuple(sorted(capture_sizes))
        self.buffers = buffers
        self.hidden = torch.zeros(self.capture_sizes[-1], hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool  # a torch.cuda.graph_pool_handle() shared with the piecewise graphs, or None: its own
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
            with forward_context(ForwardContext(kv_caches, self.buffers.graph_metadata(size), kv_scales)):
                self.hidden[:size] = self.forward(input_ids[:size], positions[:size])  # warm-up
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

    def padded_size(self, num_seqs: int, is_decode_only: bool) -> int | None:
        """The captured size a step replays, or None when it runs the compiled function instead."""
        if not is_decode_only or num_seqs > self.capture_sizes[-1]:
            return None
        return next(size for size in self.capture_sizes if size >= num_seqs)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size`` rows on what the step buffers hold; its hidden states, padding included."""
        self.graphs[size].replay()
        return self.hidden[:size]
