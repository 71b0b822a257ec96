"""A step's forward inputs from rank 0 to the other ranks, and the KV cache's size they agree on.

A fixed-size header (the command, every tensor's length, the step's path and padded size) over the control group,
then the tensors packed into one int64 payload over the collective group: on the CPU both are the one gloo group; on
CUDA the header crosses gloo (host values) and the payload NCCL, where it is on the device already (rank 0 reads
nothing back, so the step's launch does not wait for the one before it). Only tensors cross the groups, never a
pickle: the groups' store listens on loopback, where any local process may connect. For the same reason a rank
checks each header against the largest step the model's config allows (``StepBounds``) before it allocates the
payload: a header past them is not rank 0's, and the rank stops (which loses the model) rather than allocate it.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.attention.forward_context import AttentionMetadata
from kiln.step_record import StepPath

STEP, STOP = 1, 2
_PATHS = tuple(StepPath)  # a path crosses as its index
# command, tokens, slots, query starts, sequence lengths, table rows, table columns, 3 ints, path, padded size
_HEADER = 12
# A rank waits for rank 0's next step for as long as the model is idle; a dead rank 0 ends the wait at once.
IDLE_WAIT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class StepBounds:
    """The largest step of the model's EngineConfig: max_num_batched_tokens, max_num_seqs, max_blocks_per_seq."""

    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    path: StepPath  # how rank 0 runs the step: every rank runs it the same way
    padded_size: int  # the graph size it replays (tokens when no graph)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:
        options.timeout = timeout
    group.broadcast([tensor], options).wait()


def agree_num_blocks(control: dist.ProcessGroup, num_blocks: int) -> int:
    """Every rank: the KV blocks each can hold in, the fewest any can hold out. Every rank's cache has that many
    blocks, so a block table means the same on every rank."""
    blocks = torch.tensor([num_blocks], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    control.allreduce([blocks], options).wait()
    return int(blocks)


def send_step(control: dist.ProcessGroup, collective: dist.ProcessGroup, input_ids: torch.Tensor,
              positions: torch.Tensor, metadata: AttentionMetadata, path: StepPath, padded_size: int) -> None:
    """Rank 0: the step's inputs to every other rank."""
    m = metadata
    parts = (input_ids, positions, m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables.reshape(-1))
    header = torch.tensor([STEP, input_ids.numel(), m.slot_mapping.numel(), m.query_start_loc.numel(),
                           m.seq_lens.numel(), *m.block_tables.shape, m.max_query_len, m.num_seqs, m.num_decodes,
                           _PATHS.index(path), padded_size], dtype=torch.int64)
    _broadcast(control, header)
    _broadcast(collective, torch.cat([p.reshape(-1).to(torch.int64) for p in parts]))


def send_stop(control: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Rank 0: the other ranks leave their loop and exit."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = STOP
    _broadcast(control, header, timeout)


def receive_step(control: dist.ProcessGroup, collective: dist.ProcessGroup, device: str,
                 bounds: StepBounds) -> StepInputs | None:
    """The other ranks: rank 0's next step, or None when it says stop. ValueError for a header past ``bounds``."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    _broadcast(control, header, IDLE_WAIT)
    values = header.tolist()
    (command, tokens, slots, starts, lens, rows, cols, max_query_len, num_seqs, num_decodes, path,
     padded_size) = values
    if command == STOP:
        return None
    _check(values, bounds)
    payload = torch.empty(2 * tokens + slots + starts + lens + rows * cols, dtype=torch.int64, device=device)
    _broadcast(collective, payload)
    ids, positions, slot_mapping, query_start_loc, seq_lens, tables = payload.split(
        [tokens, tokens, slots, starts, lens, rows * cols])
    metadata = AttentionMetadata(slot_mapping, query_start_loc.int(), seq_lens.int(), tables.int().reshape(rows, cols),
                                 max_query_len, num_seqs, num_decodes)
    return StepInputs(ids, positions, metadata, _PATHS[path], padded_size)


def _check(header: list[int], bounds: StepBounds) -> None:
    command, tokens, slots, starts, lens, rows, cols, max_query_len, num_seqs, num_decodes, path, padded = header
    b = bounds
    fits = (command == STEP and 0 < tokens <= b.max_tokens and slots == tokens and 0 < lens <= b.max_seqs
            and starts == lens + 1 and rows == lens and 0 < cols <= b.max_blocks_per_seq
            and 0 < max_query_len <= tokens and 0 < num_seqs <= lens and 0 <= num_decodes <= num_seqs
            and 0 <= path < len(_PATHS) and tokens <= padded <= max(b.max_tokens, b.max_seqs))
    if not fits:
        raise ValueError(f"a step header past the model's bounds {b} (not rank 0's): {header}")
