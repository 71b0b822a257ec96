"""A step's forward inputs from rank 0 to the other ranks: two broadcasts over the model's process group.

A fixed-size header (the command and every tensor's length), then the tensors packed into one int64 payload. Only
tensors cross the group, never a pickle: the group's store listens on loopback, where any local process may connect.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.attention.forward_context import AttentionMetadata

STEP, STOP = 1, 2
_HEADER = 10  # command, tokens, slots, query starts, sequence lengths, table rows, table columns, and 3 ints
# A rank waits for rank 0's next step for as long as the model is idle; a dead rank 0 ends the wait at once.
IDLE_WAIT = datetime.timedelta(days=365)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:
        options.timeout = timeout
    group.broadcast([tensor], options).wait()


def send_num_blocks(group: dist.ProcessGroup, num_blocks: int) -> None:
    """Rank 0, once the ranks have joined: the blocks of its KV cache, which every rank's has as well."""
    _broadcast(group, torch.tensor([num_blocks], dtype=torch.int64))


def receive_num_blocks(group: dist.ProcessGroup) -> int:
    blocks = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, blocks)
    return int(blocks)


def send_step(group: dist.ProcessGroup, input_ids: torch.Tensor, positions: torch.Tensor,
              metadata: AttentionMetadata) -> None:
    """Rank 0: the step's inputs to every other rank."""
    m = metadata
    parts = (input_ids, positions, m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables.reshape(-1))
    header = torch.tensor([STEP, input_ids.numel(), m.slot_mapping.numel(), m.query_start_loc.numel(),
                           m.seq_lens.numel(), *m.block_tables.shape, m.max_query_len, m.num_seqs, m.num_decodes],
                          dtype=torch.int64)
    _broadcast(group, header)
    _broadcast(group, torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts]))


def send_stop(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Rank 0: the other ranks leave their loop and exit."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = STOP
    _broadcast(group, header, timeout)


def receive_step(group: dist.ProcessGroup, device: str) -> StepInputs | None:
    """The other ranks: rank 0's next step, or None when it says stop."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    _broadcast(group, header, IDLE_WAIT)
    command, tokens, slots, starts, lens, rows, cols, max_query_len, num_seqs, num_decodes = header.tolist()
    if command == STOP:
        return None
    payload = torch.empty(2 * tokens + slots + starts + lens + rows * cols, dtype=torch.int64)
    _broadcast(group, payload)
    ids, positions, slot_mapping, query_start_loc, seq_lens, tables = (
        t.to(device) for t in payload.split([tokens, tokens, slots, starts, lens, rows * cols]))
    metadata = AttentionMetadata(slot_mapping, query_start_loc.int(), seq_lens.int(), tables.int().reshape(rows, cols),
                                 max_query_len, num_seqs, num_decodes)
    return StepInputs(ids, positions, metadata)
