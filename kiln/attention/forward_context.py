"""The per-step attention metadata that Kiln's attention op reads, set by the model runner around each forward.

The op is opaque to Dynamo, so the compiled graph only passes q/k/v and the layer index; the paged KV cache and
the step's block tables live here, owned by the runner for exactly the duration of one forward.
"""

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from kiln.thread_value import ThreadValue


@dataclass
class AttentionMetadata:
    """Where each token of a flattened step belongs in the paged KV cache.

    Tokens of all sequences are concatenated along one dimension; sequence i owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` whose context ends at ``seq_lens[i]``.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each token; -1 for padding (skipped)
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    num_seqs: int  # real sequences; rows past it are CUDA-graph padding
    num_decodes: int = 0  # leading sequences with one query token (the engine schedules decodes first)
    # A CUDA graph's step, captured for any mix of rows: the decode and prefill kernels both run over every row,
    # each taking the rows its query length selects; max_query_len is the graph's token count, a bound.
    any_rows: bool = False
    # [>= B, Hkv] int32, zeros between steps, kept by the runner (StepBuffers) across steps and graph replays: with
    # it the decode's splits of each (sequence, kv head) are merged by the last to end, without a reduce kernel.
    split_counters: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata
    kv_scales: list[torch.Tensor] | None = None  # per layer of an FP8 cache: [2, num_kv_heads] float32 (k's, v's)


# Per thread: each model's engine steps in its own thread, and another model may profile or load meanwhile.
_current: ThreadValue[ForwardContext] = ThreadValue()


def forward_context(ctx: ForwardContext) -> AbstractContextManager[None]:
    """Make ``ctx`` visible to the attention op for the duration of one forward."""
    return _current.set(ctx)


def current_forward_context() -> ForwardContext | None:
    """The context of the forward in flight, or None outside the engine (plain causal attention)."""
    return _current.get()
