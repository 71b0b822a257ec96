"""One step's scheduled tokens flattened into the tensors the forward reads: ids, positions, attention metadata."""

from dataclasses import dataclass

import torch

from exec_service.engine.scheduler import ScheduledBatch
from kiln.forward_context import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: the last token of each sequence that samples this step

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prepare(batch: ScheduledBatch, block_size: int, device: str) -> StepInputs:
    """Built on the host, copied to the device without blocking (pinned memory on CUDA)."""
    input_ids, positions, slots, query_start_loc, seq_lens, sample_rows = [], [], [], [0], [], []
    for entry in batch.entries:
        table = entry.seq.block_table
        input_ids += entry.seq.token_ids[entry.start:entry.end]
        span = range(entry.start, entry.end)
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        query_start_loc.append(query_start_loc[-1] + entry.num_new_tokens)
        seq_lens.append(entry.end)
        if entry.samples:
            sample_rows.append(query_start_loc[-1] - 1)
    width = max(len(e.seq.block_table) for e in batch.entries)
    block_tables = [e.seq.block_table + [0] * (width - len(e.seq.block_table)) for e in batch.entries]

    def tensor(values, dtype):
        host = torch.tensor(values, dtype=dtype, pin_memory=device == "cuda")
        return host.to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(block_tables, torch.int32),
        max_query_len=max(e.num_new_tokens for e in batch.entries),
        num_seqs=batch.num_seqs,
    )
    return StepInputs(tensor(input_ids, torch.int64), tensor(positions, torch.int64), metadata,
                      tensor(sample_rows, torch.int64))
