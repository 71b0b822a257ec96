"""A step's penalties, min_tokens bans and logprobs, as device tensors for the sampler: built only where a row asks.

Penalties count the tokens before the position being sampled. The host knows all of them but the last, which may
be the previous step's sample, still on the device (async scheduling: a decode's input token); the last comes from
the step's own input ids on the device, so nothing waits for it. The host's part travels as (row, token id) pairs,
one per token of the penalised sequences (not per vocabulary entry), through pinned memory, so the copy does not
wait for the step in flight either; the device turns them into per-row counts.
"""

from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch

from exec_service.engine.scheduler import ScheduledSequence


@dataclass
class Penalties:
    """Of the penalised rows only (``rows`` of the step's sampled rows); neutral values leave a row unchanged."""

    rows: torch.Tensor  # [P] int64: which sampled rows
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    output_counts: torch.Tensor  # [P, V] float32: times each token is in the output before the sampled position
    seen: torch.Tensor  # [P, V] bool: in the prompt or the output before it


@dataclass
class SamplingOptions:
    penalties: Penalties | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf: min_tokens not reached yet
    num_top_logprobs: int | None  # None: no row wants logprobs; else the most alternatives a row wants


def sampling_options(entries: Rows[ScheduledSequence], last_input_ids: torch.Tensor, vocab_size: int
                     ) -> SamplingOptions | None:
    """For the step's sampling ``entries`` (in row order); ``last_input_ids`` [S] on the device: each row's input
    token at the position before the sampled one. None when no row has a penalty, min_tokens or logprobs."""
    penalised, ban_rows, ban_ids, num_top = [], [], [], None
    for row, entry in enumerate(entries):
        seq = entry.seq
        params = seq.params
        if params.has_penalties:
            penalised.append(row)
        if entry.end - seq.num_prompt_tokens < params.min_tokens:
            ends = sorted(seq.end_token_ids)
            ban_rows += [row] * len(ends)
            ban_ids += ends
        if params.logprobs:
            num_top = max(num_top or 0, params.top_logprobs)
    if not penalised and not ban_ids and num_top is None:
        return None
    device = last_input_ids.device
    banned = (_to_device(ban_rows, device), _to_device(ban_ids, device)) if ban_ids else None
    penalties = _penalties([entries[row] for row in penalised], penalised, last_input_ids, vocab_size) \
        if penalised else None
    return SamplingOptions(penalties, banned, num_top)


def _penalties(entries: list[ScheduledSequence], rows: list[int], last_input_ids: torch.Tensor,
               vocab_size: int) -> Penalties:
    device = last_input_ids.device
    params = [e.seq.params for e in entries]
    with_prompt = any(p.repetition_penalty != 1.0 for p in params)  # only the repetition penalty reads the prompt
    out_rows, out_ids, prompt_rows, prompt_ids, last_is_output = [], [], [], [], []
    for i, entry in enumerate(entries):
        seq, before_last = entry.seq, entry.end - 1
        if with_prompt:
            prompt_end = min(seq.num_prompt_tokens, before_last)
            prompt_ids += seq.token_ids[:prompt_end]
            prompt_rows += [i] * prompt_end
        output = seq.token_ids[seq.num_prompt_tokens:before_last]
        out_ids += output
        out_rows += [i] * len(output)
        last_is_output.append(before_last >= seq.num_prompt_tokens)
    num, one = len(entries), torch.ones((), device=device)
    counts = torch.zeros(num, vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((_to_device(out_rows, device), _to_device(out_ids, device)), one, accumulate=True)
    in_prompt = torch.zeros(num, vocab_size, dtype=torch.float32, device=device)
    in_prompt.index_put_((_to_device(prompt_rows, device), _to_device(prompt_ids, device)), one)
    rows_t = _to_device(rows, device)
    last = last_input_ids.index_select(0, rows_t)[:, None]
    is_output = _to_device(last_is_output, device, torch.float32)[:, None]
    counts.scatter_add_(1, last, is_output)
    in_prompt.scatter_add_(1, last, 1 - is_output)
    floats = _to_device([v for p in params for v in (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)],
                        device, torch.float32).view(num, 3)
    return Penalties(rows_t, floats[:, 0], floats[:, 1], floats[:, 2], counts, (in_prompt + counts) > 0)


def _to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list on ``device`` without waiting for the device: from pinned memory on CUDA (a copy from pageable
    memory waits for the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host
