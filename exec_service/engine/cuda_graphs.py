"""CUDA graphs for decode steps: one per capture size, captured largest first into one shared memory pool.

A decode-only step of n sequences replays the graph of the smallest captured size >= n: its inputs are copied
into static buffers, the padding rows get slot -1 (the KV write skips them) and sequence length 0 (attention
returns zeros for them), and the first n rows of the static output are the step's hidden states. The attention
kernels read lengths and block tables on the device, so one capture serves every context length. CUDA only: on
CPU the runner calls the compiled function directly.
"""

import logging
import time
from collections.abc import Callable

import torch

from exec_service.engine.step_inputs import StepInputs
from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids [T], positions [T]) -> hidden [T, H]


class CUDAGraphs:
    def __init__(self, forward: Forward, capture_sizes: tuple[int, ...], max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.forward = forward
        self.capture_sizes = tuple(sorted(capture_sizes))
        max_bs = self.capture_sizes[-1]
        # The static buffers every graph reads and writes; each size uses their first rows.
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.captured_bytes = 0

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1,
            num_seqs=size)

    def capture(self, kv_caches: list[torch.Tensor], on_captured: Callable[[int, int], None] = lambda *_: None
                ) -> float:
        """Capture every size, largest first so the smaller graphs fit in the pool the largest allocated.

        ``on_captured(size, done)`` reports progress after each size. Returns the seconds it took;
        ``captured_bytes`` is the device memory the graphs hold.
        """
        start = time.perf_counter()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        for size in reversed(self.capture_sizes):
            with forward_context(ForwardContext(kv_caches, self._metadata(size))):
                self.hidden[:size] = self.forward(self.input_ids[:size], self.positions[:size])  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:size] = self.forward(self.input_ids[:size], self.positions[:size])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize()
            on_captured(size, len(self.graphs))
        free_after, _ = torch.cuda.mem_get_info()
        self.captured_bytes = max(0, free_before - free_after)
        seconds = time.perf_counter() - start
        log.info("Graph capturing finished in %.0f secs, took %.2f GiB", seconds, self.captured_bytes / (1 << 30))
        return seconds

    def padded_size(self, num_seqs: int, is_decode_only: bool) -> int | None:
        """The captured size a step replays, or None when it runs the compiled function instead."""
        if not is_decode_only or num_seqs > self.capture_sizes[-1]:
            return None
        return next(size for size in self.capture_sizes if size >= num_seqs)

    def replay(self, size: int, inputs: StepInputs) -> torch.Tensor:
        n = inputs.metadata.num_seqs
        meta = inputs.metadata
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens.zero_()
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[size].replay()
        return self.hidden[:n]
