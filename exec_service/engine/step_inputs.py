"""One step's scheduled tokens flattened into what the forward and the sampler read, in memory kept for good.

Nothing is allocated per step. The host side is two sets of pinned buffers used by alternate steps: a set is written
again only after the step that last used it has synced, so a copy still queued never reads half-written values. The
device side is one set, read by the forward and by every CUDA graph; stream order keeps step N+1's copies behind
step N's forward. A step's inputs travel to the device in three copies, one per dtype.

A decode whose input token is the previous step's sample (still on the device, or in flight) gets it there: the host
writes a placeholder and the row it comes from, and one gather on the device puts it in place before the forward.

A step is prepared in three jobs: ``flatten`` (the batch as host lists), ``pad_seqs`` / ``pad_tokens`` (the rows a
CUDA graph's size adds), and ``StepBuffers.upload`` (host set, copies, device views for the forward and the sampler).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.sampler import SamplingTensors
from exec_service.engine.scheduler import ScheduledBatch
from exec_service.engine.sequence import Sequence
from kiln.attention.forward_context import AttentionMetadata

ALIGN_BYTES = 16  # where each section of the packed step buffers starts (_Packed)


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


@dataclass
class HostStep:
    """One step flattened on the host: a row per token, a row per sequence, a row per sampled sequence."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    tables: list[int] = field(default_factory=list)  # the sequences' block tables, each ``width`` wide
    width: int = 0
    from_rows: list[int] = field(default_factory=list)  # decodes whose input is the previous step's sample:
    into_tokens: list[int] = field(default_factory=list)  # its row there, and the token row it fills here
    sample_rows: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    sample_positions: list[int] = field(default_factory=list)
    num_seqs: int = 0  # real sequences (rows past them are padding)
    num_tokens: int = 0  # real tokens
    max_query_len: int = 0
    num_decodes: int = 0


def flatten(batch: ScheduledBatch, block_size: int, vocab_size: int,
            previous_rows: Mapping[Sequence, int] | None = None) -> HostStep:
    """The batch's tokens, slots, sequences and sampling rows as host lists; ``previous_rows``: each sequence's row
    in the previous step's samples, for the decodes whose input token that step sampled."""
    step = HostStep(width=max(len(e.seq.block_table) for e in batch.entries))
    ids, positions, slots = step.ids, step.positions, step.slots
    for entry in batch.entries:
        seq, start, end = entry.seq, entry.start, entry.end
        table = seq.block_table
        known = seq.num_tokens
        if end <= known:
            ids += seq.token_ids[start:end]
        else:  # a decode of the token the previous step sampled: a placeholder, filled in on the device
            ids += seq.token_ids[start:known]
            ids.append(0)
            step.from_rows.append(previous_rows[seq])
            step.into_tokens.append(len(ids) - 1)
        if entry.num_new_tokens == 1:
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            span = range(start, end)
            positions += span
            slots += [table[p // block_size] * block_size + p % block_size for p in span]
        step.query_start_loc.append(len(ids))
        step.seq_lens.append(end)
        step.tables += table
        step.tables += [0] * (step.width - len(table))
        if entry.samples:
            params = seq.params
            step.sample_rows.append(len(ids) - 1)
            step.temperature.append(params.temperature)
            step.top_k.append(params.top_k or vocab_size)
            step.top_p.append(params.top_p)
            step.seeds.append(seq.noise_seed)
            step.sample_positions.append(end)
    step.num_seqs, step.num_tokens = len(batch.entries), len(ids)
    step.max_query_len = max(e.num_new_tokens for e in batch.entries)
    step.num_decodes = next((i for i, e in enumerate(batch.entries) if e.num_new_tokens > 1), step.num_seqs)
    return step


def pad_seqs(step: HostStep, num_seqs: int) -> None:
    """Decode rows up to a full graph's ``num_seqs``: a token each, no KV write (slot -1), an empty context."""
    pad = num_seqs - step.num_seqs
    if pad <= 0:
        return
    _pad_token_rows(step, pad)
    step.query_start_loc += range(step.num_tokens + 1, step.num_tokens + pad + 1)
    step.seq_lens += [0] * pad


def pad_rows(step: HostStep, num_tokens: int, num_seqs: int) -> None:
    """Tokens up to a mixed graph's ``num_tokens``, in no sequence, so they write no KV and read none; and sequence
    rows up to its ``num_seqs``, with no query token and an empty context, so every kernel passes them by."""
    _pad_token_rows(step, num_tokens - step.num_tokens)
    pad = num_seqs - step.num_seqs
    step.query_start_loc += [step.num_tokens] * pad
    step.seq_lens += [0] * pad


def _pad_token_rows(step: HostStep, pad: int) -> None:
    step.ids += [0] * pad
    step.positions += [0] * pad
    step.slots += [-1] * pad


class _Packed:
    """Named sections of one flat buffer of one dtype: two pinned host copies and one device copy.

    Each section starts 16 bytes aligned, as a tensor of its own would: Triton specialises a kernel on whether each
    pointer argument is, so a view at another alignment than the warm-up's tensors built a kernel while serving."""

    def __init__(self, dtype: torch.dtype, sizes: dict[str, int], device: str):
        self.offsets: dict[str, tuple[int, int]] = {}
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = (total, size)
            total += -(-size // align) * align
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
                 device: str, num_kv_heads: int = 0):
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
        # The decode kernels' split counters (AttentionMetadata.split_counters), on CUDA, for a cache of
        # num_kv_heads heads (this rank's).
        self.split_counters = (torch.zeros(max_seqs, num_kv_heads, dtype=torch.int32, device=device)
                               if num_kv_heads and device == "cuda" else None)
        self.input_ids = self._long.device_view("input_ids")
        self.positions = self._long.device_view("positions")
        self.slot_mapping = self._long.device_view("slot_mapping")
        self.query_start_loc = self._int.device_view("query_start_loc")
        self.seq_lens = self._int.device_view("seq_lens")
        # What a CUDA graph's padding rows need before capture: no KV write (slot -1), an empty context.
        self.slot_mapping.fill_(-1)
        self.query_start_loc.copy_(torch.arange(max_seqs + 1, dtype=torch.int32))
        self._steps = 0

    @classmethod
    def for_config(cls, config: EngineConfig, vocab_size: int, num_kv_heads: int = 0) -> "StepBuffers":
        return cls(config.max_num_batched_tokens, config.max_num_seqs, config.max_blocks_per_seq, config.block_size,
                   vocab_size, config.device, num_kv_heads)

    def graph_metadata(self, size: int) -> AttentionMetadata:
        """The metadata a decode graph of ``size`` rows is captured with: views of the device buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1, num_seqs=size,
            split_counters=self.split_counters)

    def mixed_rows(self, num_tokens: int) -> int:
        """The sequence rows of a mixed graph of ``num_tokens``: as many as such a step can hold."""
        return min(num_tokens, self.max_seqs)

    def mixed_graph_metadata(self, num_tokens: int) -> AttentionMetadata:
        """The metadata a mixed graph of ``num_tokens`` is captured with: views of the device buffers, every row
        (``mixed_rows``) for either kernel, the longest query bounded by the token count."""
        rows = self.mixed_rows(num_tokens)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], query_start_loc=self.query_start_loc[:rows + 1],
            seq_lens=self.seq_lens[:rows], block_tables=self.block_tables[:rows], max_query_len=num_tokens,
            num_seqs=rows, any_rows=True, split_counters=self.split_counters)

    def prepare(self, batch: ScheduledBatch, padded_seqs: int | None = None,
                previous_sampled: torch.Tensor | None = None,
                previous_rows: Mapping[Sequence, int] | None = None,
                padded_tokens: int | None = None) -> tuple[StepInputs, int]:
        """Fill this step's host set, queue its copies and the gather of input tokens from ``previous_sampled``.

        ``padded_seqs``: the decode graph's size to pad decode rows to; ``padded_tokens``: the mixed graph's size
        to pad tokens (and sequence rows, ``mixed_rows``) to. ``previous_rows``: each sequence's row in
        ``previous_sampled``. Returns the inputs and the parity of the host set used (the sampled ids come back into
        ``sampled_host[parity]``).
        """
        step = flatten(batch, self.block_size, self.vocab_size, previous_rows)
        if padded_seqs is not None:
            pad_seqs(step, padded_seqs)
        if padded_tokens is not None:
            pad_rows(step, padded_tokens, self.mixed_rows(padded_tokens))
        return self.upload(step, previous_sampled)

    def upload(self, step: HostStep, previous_sampled: torch.Tensor | None = None) -> tuple[StepInputs, int]:
        """Write ``step`` into the next host set, queue its copies to the device, and give the device views."""
        parity = self._steps % 2
        self._steps += 1
        long, floats, ints = self._long, self._float, self._int
        for name, values in (("input_ids", step.ids), ("positions", step.positions), ("slot_mapping", step.slots),
                             ("sample_rows", step.sample_rows), ("from_rows", step.from_rows),
                             ("into_tokens", step.into_tokens), ("top_k", step.top_k), ("seeds", step.seeds),
                             ("sample_positions", step.sample_positions)):
            long.host_view(parity, name)[:len(values)] = values
        floats.host_view(parity, "temperature")[:len(step.temperature)] = step.temperature
        floats.host_view(parity, "top_p")[:len(step.top_p)] = step.top_p
        ints.host_view(parity, "query_start_loc")[:len(step.query_start_loc)] = step.query_start_loc
        ints.host_view(parity, "seq_lens")[:len(step.seq_lens)] = step.seq_lens
        ints.host_view(parity, "block_table_rows")[:len(step.tables)] = step.tables
        long.copy(parity)
        floats.copy(parity)
        ints.copy(parity, ints.offsets["block_table_rows"][0] + len(step.tables))
        self.block_tables[:step.num_seqs, :step.width].copy_(
            ints.device_view("block_table_rows")[:len(step.tables)].view(step.num_seqs, step.width))
        if step.from_rows:
            count = len(step.from_rows)
            into = long.device_view("into_tokens")[:count]
            self.input_ids.index_copy_(0, into, previous_sampled.index_select(0, long.device_view("from_rows")[:count]))
        return self._inputs(step), parity

    def _inputs(self, step: HostStep) -> StepInputs:
        long, floats = self._long, self._float
        total_tokens, total_seqs, num_samples = len(step.ids), len(step.seq_lens), len(step.sample_rows)
        sampling = SamplingTensors(
            temperature=floats.device_view("temperature")[:num_samples], top_k=long.device_view("top_k")[:num_samples],
            top_p=floats.device_view("top_p")[:num_samples], seeds=long.device_view("seeds")[:num_samples],
            positions=long.device_view("sample_positions")[:num_samples],
            all_greedy=all(t == 0 for t in step.temperature),
            any_top_k_top_p=any(k < self.vocab_size for k in step.top_k) or any(p < 1.0 for p in step.top_p))
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:total_tokens], query_start_loc=self.query_start_loc[:total_seqs + 1],
            seq_lens=self.seq_lens[:total_seqs], block_tables=self.block_tables[:total_seqs],
            max_query_len=step.max_query_len, num_seqs=step.num_seqs, num_decodes=step.num_decodes,
            split_counters=self.split_counters)
        return StepInputs(self.input_ids[:total_tokens], self.positions[:total_tokens], metadata,
                          long.device_view("sample_rows")[:num_samples], sampling)
