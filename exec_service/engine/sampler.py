"""Sampling on the device for a whole step at once: greedy, temperature, top-k, top-p, seeds, penalties, min_tokens
and logprobs, no host sync.

A sampled row takes ``argmax(logits / temperature + gumbel)`` (the Gumbel-max trick: token i wins with probability
``softmax(logits / temperature)[i]``). The noise is counter-based, as in vLLM's GPU model runner: a hash of the
request's seed, the position of the token being sampled and the token id. So a request's tokens depend on its seed
and logits only: not on which requests share its steps, on how often it was preempted and recomputed, or on a
speculative step whose token was thrown away. Requests without a seed are given a random one when they arrive.

Penalties and min_tokens act on the logits first, row by row (a row without them is left as it is), so they change
what greedy and sampled rows take alike. Logprobs are of the model's own distribution, ``log_softmax(logits)``
before penalties, temperature, top-k and top-p (vLLM's default, ``raw_logprobs``): what the model thinks of the
token, whichever way it was drawn.

Nothing here reads the device; the engine copies the sampled ids back once per step.
"""

from dataclasses import dataclass

import torch

from exec_service.engine.sampling_options import Penalties, SamplingOptions

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 (MurmurHash2's and xxHash32's), so no int64 product of a 32-bit value overflows.
_MULTIPLIERS = (0x5BD1E995, 0x27D4EB2F, 0x165667B1)
_TOKEN_SALT = 0x7FEB352D


@dataclass
class SamplingTensors:
    """Per sampled row, on the device; the flags are known on the host, so a greedy step does nothing more."""

    temperature: torch.Tensor  # [S] float32; 0 is greedy
    top_k: torch.Tensor  # [S] int64; the vocabulary size keeps every token
    top_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64: where the sampled token goes in its sequence
    all_greedy: bool
    any_top_k_top_p: bool


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and its position's most likely tokens, most likely first (host values)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SampledLogprobs:
    """Per sampled row: the sampled token's log-probability and the ``k`` most likely tokens' (k may be 0)."""

    logprob: torch.Tensor  # [S] float32
    top_ids: torch.Tensor  # [S, k] int64
    top_logprobs: torch.Tensor  # [S, k] float32

    def to_host(self) -> "SampledLogprobs":
        """Copies queued into pinned memory on CUDA (read them after the step's sync)."""
        pin = self.logprob.device.type == "cuda"
        return SampledLogprobs(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=True)
                                 for t in (self.logprob, self.top_ids, self.top_logprobs)))

    def of_row(self, row: int, token_id: int, num_top: int) -> TokenLogprobs:
        ids, logprobs = self.top_ids[row, :num_top].tolist(), self.top_logprobs[row, :num_top].tolist()
        return TokenLogprobs(token_id, self.logprob[row].item(), tuple(zip(ids, logprobs, strict=True)))


def sample(logits: torch.Tensor, params: SamplingTensors, options: SamplingOptions | None = None) -> torch.Tensor:
    """logits [S, V] float32 -> [S] int64 token ids, on the logits' device; ``logits`` is left as it is."""
    if options is not None:
        logits = logits.clone()
        if options.banned is not None:
            # torch.full fills on the device; torch.tensor(value, device=...) would copy from pageable memory and
            # wait for the step in flight.
            logits.index_put_(options.banned, torch.full((), float("-inf"), device=logits.device))
        if options.penalties is not None:
            _penalise(logits, options.penalties)
    greedy = logits.argmax(dim=-1)
    if params.all_greedy:
        return greedy
    temperature = params.temperature
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if params.any_top_k_top_p:
        scaled = _top_k_top_p(scaled, params.top_k, params.top_p)
    uniform = counter_uniform(params.seeds, params.positions, logits.shape[-1])
    sampled = scaled.add_(uniform.log_().neg_().log_().neg_()).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def logprobs(logits: torch.Tensor, sampled: torch.Tensor, num_top: int) -> SampledLogprobs:
    """The raw model distribution's log-probabilities of ``sampled`` [S] and of each row's ``num_top`` best."""
    all_logprobs = logits.log_softmax(dim=-1)
    top = all_logprobs.topk(num_top, dim=-1)
    return SampledLogprobs(all_logprobs.gather(1, sampled[:, None])[:, 0], top.indices, top.values)


def _penalise(logits: torch.Tensor, p: Penalties) -> None:
    """Repetition (transformers' RepetitionPenaltyLogitsProcessor), then frequency and presence (OpenAI's), in
    place on the penalised rows."""
    rows = logits.index_select(0, p.rows)
    repetition = p.repetition[:, None]
    rows = torch.where(p.seen, torch.where(rows < 0, rows * repetition, rows / repetition), rows)
    rows -= p.frequency[:, None] * p.output_counts + p.presence[:, None] * (p.output_counts > 0)
    logits.index_copy_(0, p.rows, rows)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 strictly inside (0, 1): a pure function of (seed, position, token id), on any device."""
    key = _mix32((seeds >> 32) & _MASK32)
    key = _mix32(key ^ (seeds & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    tokens = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) ^ _TOKEN_SALT)
    return unit_interval(_mix32(key[:, None] ^ tokens[None, :]))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in [2**-24, 1 - 2**-24]: 23 bits, each value exact in float32 (24 bits would round
    the largest to 1.0, whose Gumbel noise is infinite)."""
    return (bits >> 9).to(torch.float32).add_(0.5).mul_(2.0**-23)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An xorshift-multiply hash of 32-bit values held in int64 (a new tensor; ``x`` is left alone)."""
    x = x ^ (x >> 16)
    for multiplier, shift in zip(_MULTIPLIERS, (15, 13, 16), strict=True):
        x.mul_(multiplier).bitwise_and_(_MASK32)
        x.bitwise_xor_(x >> shift)
    return x


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside its row's k most likely and outside its smallest top-p nucleus."""
    ordered, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    ordered = ordered.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays: its mass_before is 0
    ordered = ordered.masked_fill(mass_before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, ordered)
