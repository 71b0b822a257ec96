"""One step's scheduled tokens flattened into what the forward and the sampler read, in memory kept for good.

Nothing is allocated per step. The host side is two sets of pinned buffers used by alternate steps: a set is written
again only after the step that last used it has synced, so a copy still queued never reads half-written values. The
device side is one set, read by the forward and by every CUDA graph; stream order keeps step N+1's copies behind
step N's forward. A step's inputs travel to the device in three copies, one per dtype.

A decode whose input token is the previous step's sample (still on the device, or in flight) gets it there: the host
writes a placeholder and the row it comes from, and one gather on the device puts it in place before the forward.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from exec_service.engine.sampler import SamplingTensors
from exec_service.engine.scheduler import ScheduledBatch
from exec_service.engine.sequence import Sequence
from kiln.attention.forward_context import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (CUDA-graph padding included)
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: the last token of each sequence that samples this step
    sampling: SamplingTensors

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class _Packed:
    """Named sections of one flat buffer of one dtype: two pinned host copies and one device copy."""

    def __init__(self, dtype: torch.dtype, sizes: dict[str, int], device: str):
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = (total, size)
            total += size
        pin = device == "cuda"
        self.host = [torch.zeros(total, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.device = torch.zeros(total, dtype=dtype, device=device)

    def host_view(self, parity: int, name: str):
        start, size = self.offsets[name]
        return self.host_np[parity][start:start + size]

    def device_view(self, name: str) -> torch.Tensor:
        start, size = self.offsets[name]
        return self.device[start:start + size]

    def copy(self, parity: int, end: int | None = None) -> None:
        end = self.device.shape[0] if end is None else end
        self.device[:end].copy_(self.host[parity][:end], non_blocking=True)


class StepBuffers:
    """The step inputs of one model: ``prepare`` fills them for a batch; CUDA graphs capture their device views."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int, vocab_size: int,
                 device: str):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.block_size, self.vocab_size, self.device = block_size, vocab_size, device
        self._long = _Packed(torch.int64, dict(
            input_ids=max_tokens, positions=max_tokens, slot_mapping=max_tokens, sample_rows=max_seqs,
            from_rows=max_seqs, into_tokens=max_seqs, top_k=max_seqs, seeds=max_seqs, sample_positions=max_seqs),
            device)
        self._float = _Packed(torch.float32, dict(temperature=max_seqs, top_p=max_seqs), device)
        # The block tables travel as the step's rows only ([n, widest table] at the front), then spread on the
        # device into the full-width table the kernels and the graphs read.
        self._int = _Packed(torch.int32, dict(query_start_loc=max_seqs + 1, seq_lens=max_seqs,
                                              block_table_rows=max_seqs * max_blocks_per_seq), device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.sampled_host = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=device == "cuda") for _ in range(2)]
        self.input_ids = self._long.device_view("input_ids")
        self.positions = self._long.device_view("positions")
        self.slot_mapping = self._long.device_view("slot_mapping")
        self.query_start_loc = self._int.device_view("query_start_loc")
        self.seq_lens = self._int.device_view("seq_lens")
        # What a CUDA graph's padding rows need before capture: no KV write (slot -1), an empty context.
        self.slot_mapping.fill_(-1)
        self.query_start_loc.copy_(torch.arange(max_seqs + 1, dtype=torch.int32))
        self._steps = 0

    def graph_metadata(self, size: int) -> AttentionMetadata:
        """The metadata a decode graph of ``size`` rows is captured with: views of the device buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1, num_seqs=size)

    def prepare(self, batch: ScheduledBatch, padded_seqs: int | None = None,
                previous_sampled: torch.Tensor | None = None,
                previous_rows: Mapping[Sequence, int] | None = None) -> tuple[StepInputs, int]:
        """Fill this step's host set, queue its copies and the gather of input tokens from ``previous_sampled``.

        ``padded_seqs``: the CUDA-graph size to pad decode rows to. ``previous_rows``: each sequence's row in
        ``previous_sampled``, for the decodes whose input token was sampled by the previous step. Returns the
        inputs and the parity of the host set used (the sampled ids come back into ``sampled_host[parity]``).
        """
        parity = self._steps % 2
        self._steps += 1
        block_size = self.block_size
        ids, positions, slots, query_start_loc, seq_lens, sample_rows = [], [], [], [0], [], []
        from_rows, into_tokens, tables = [], [], []
        temperature, top_k, top_p, seeds, sample_positions = [], [], [], [], []
        width = max(len(e.seq.block_table) for e in batch.entries)
        for entry in batch.entries:
            seq, start, end = entry.seq, entry.start, entry.end
            table = seq.block_table
            known = seq.num_tokens
            if end <= known:
                ids += seq.token_ids[start:end]
            else:  # a decode of the token the previous step sampled: a placeholder, filled in on the device
                ids += seq.token_ids[start:known]
                ids.append(0)
                from_rows.append(previous_rows[seq])
                into_tokens.append(len(ids) - 1)
            if entry.num_new_tokens == 1:
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                span = range(start, end)
                positions += span
                slots += [table[p // block_size] * block_size + p % block_size for p in span]
            query_start_loc.append(len(ids))
            seq_lens.append(end)
            tables += table
            tables += [0] * (width - len(table))
            if entry.samples:
                params = seq.params
                sample_rows.append(len(ids) - 1)
                temperature.append(params.temperature)
                top_k.append(params.top_k or self.vocab_size)
                top_p.append(params.top_p)
                seeds.append(seq.noise_seed)
                sample_positions.append(end)
        num_seqs, num_tokens = len(batch.entries), len(ids)
        if padded_seqs is not None and padded_seqs > num_seqs:  # CUDA-graph rows: no KV write, empty context
            pad = padded_seqs - num_seqs
            ids += [0] * pad
            positions += [0] * pad
            slots += [-1] * pad
            query_start_loc += range(num_tokens + 1, num_tokens + pad + 1)
            seq_lens += [0] * pad
        total_tokens, total_seqs = len(ids), len(seq_lens)
        long, floats, ints = self._long, self._float, self._int
        for name, values in (("input_ids", ids), ("positions", positions), ("slot_mapping", slots),
                             ("sample_rows", sample_rows), ("from_rows", from_rows), ("into_tokens", into_tokens),
                             ("top_k", top_k), ("seeds", seeds), ("sample_positions", sample_positions)):
            long.host_view(parity, name)[:len(values)] = values
        floats.host_view(parity, "temperature")[:len(temperature)] = temperature
        floats.host_view(parity, "top_p")[:len(top_p)] = top_p
        ints.host_view(parity, "query_start_loc")[:total_seqs + 1] = query_start_loc
        ints.host_view(parity, "seq_lens")[:total_seqs] = seq_lens
        ints.host_view(parity, "block_table_rows")[:len(tables)] = tables
        long.copy(parity)
        floats.copy(parity)
        ints.copy(parity, ints.offsets["block_table_rows"][0] + len(tables))
        self.block_tables[:num_seqs, :width].copy_(
            ints.device_view("block_table_rows")[:len(tables)].view(num_seqs, width))
        if from_rows:
            count = len(from_rows)
            into = long.device_view("into_tokens")[:count]
            self.input_ids.index_copy_(0, into, previous_sampled.index_select(0, long.device_view("from_rows")[:count]))

        num_samples = len(sample_rows)
        sampling = SamplingTensors(
            temperature=floats.device_view("temperature")[:num_samples], top_k=long.device_view("top_k")[:num_samples],
            top_p=floats.device_view("top_p")[:num_samples], seeds=long.device_view("seeds")[:num_samples],
            positions=long.device_view("sample_positions")[:num_samples],
            all_greedy=all(t == 0 for t in temperature),
            any_top_k_top_p=any(k < self.vocab_size for k in top_k) or any(p < 1.0 for p in top_p))
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:total_tokens], query_start_loc=self.query_start_loc[:total_seqs + 1],
            seq_lens=self.seq_lens[:total_seqs], block_tables=self.block_tables[:total_seqs],
            max_query_len=max(e.num_new_tokens for e in batch.entries), num_seqs=num_seqs,
            num_decodes=next((i for i, e in enumerate(batch.entries) if e.num_new_tokens > 1), num_seqs))
        inputs = StepInputs(self.input_ids[:total_tokens], self.positions[:total_tokens], metadata,
                            long.device_view("sample_rows")[:num_samples], sampling)
        return inputs, parity
