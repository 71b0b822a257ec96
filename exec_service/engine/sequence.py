"""One request's state in the engine: its tokens, how many have KV in the cache, its blocks and its stop rules."""

import enum
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # OpenAI's: subtracted from the logit of a token once if it is in the output (presence), once per time (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # transformers' and vLLM's: divides (multiplies) the positive (negative) logit
    min_tokens: int = 0  # no end-of-sequence or stop token before this many output tokens
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely alternatives per position

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence or stop token was sampled
    LENGTH = "length"  # max_tokens or max_model_len was reached


@dataclass(frozen=True)
class Usage:
    """What a request used and how long it took, as its last output reports it."""

    prompt_tokens: int
    output_tokens: int
    time_to_first_token_s: float  # arrival to the first token
    total_s: float  # arrival to the end
    queue_s: float  # arrival to the first schedule
    num_preemptions: int
    cached_tokens: int = 0  # prompt tokens its first prefill found in the prefix cache


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """Prompt plus output tokens; ``num_computed_tokens`` of them have their keys and values in the cache, or will
    have once the steps in flight have run (it advances when a step is scheduled).

    ``num_pending`` tokens were sampled by steps in flight and are not known on the host yet: they follow
    ``token_ids``, and a decode whose input is one of them takes it from the previous step's output on the device.
    Preemption by recompute sets ``num_computed_tokens`` back to 0 and frees the blocks; the output tokens are kept,
    so the next prefill covers prompt and output alike and sampling resumes where it stopped.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_pending: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its first full blocks (block_hash.extend_chain)
    num_cached_tokens: int = 0  # tokens its first prefill found in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None  # set when it finishes
    # (wall-clock ns, tokens whose KV was dropped) per preemption: the request span's events.
    preemptions: list[tuple[int, int]] = field(default_factory=list)
    arrival_s: float = field(default_factory=time.perf_counter)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    # Host clock when each output token was appended (its step's tokens read): the inter-token latency histogram's
    # gaps, observed off the engine thread once the request ends.
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    noise_seed: int = 0  # keys the sampler's noise: the request's seed, or a random one the engine gives it
    index: int = 0  # which of its request's n sequences (they share the request id)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.noise_seed = self.params.seed

    @property
    def num_preemptions(self) -> int:
        return len(self.preemptions)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Prompt and output tokens at the longest: reaching it finishes the sequence."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_model_len)

    @property
    def reaches_max_tokens(self) -> bool:
        """Its last token is sampled already, by a step in flight: nothing is left to schedule."""
        return self.num_tokens + self.num_pending >= self.max_total_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Tokens whose keys and values the cache must hold at the longest: the last sampled token never runs."""
        return self.max_total_tokens - 1

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The tokens that finish it when sampled: its stop tokens and, unless ignored, end-of-sequence."""
        return self.params.stop_token_ids if self.params.ignore_eos else self.params.stop_token_ids | self.eos_token_ids

    def append_token(self, token_id: int, now_s: float) -> None:
        """``now_s``: the host clock (``time.perf_counter``) when the step's tokens were read, one reading per step."""
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.token_times_s.append(now_s)
        self.token_ids.append(token_id)
        if token_id in self.end_token_ids:
            self.finish(FinishReason.STOP)
        elif len(self.token_ids) >= self.max_total_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finished_s = time.perf_counter()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def usage(self) -> Usage:
        end = self.finished_s or time.perf_counter()
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            output_tokens=len(self.output_token_ids),
            time_to_first_token_s=(self.first_token_s or end) - self.arrival_s,
            total_s=end - self.arrival_s,
            queue_s=(self.first_scheduled_s or end) - self.arrival_s,
            num_preemptions=self.num_preemptions,
            cached_tokens=self.num_cached_tokens,
        )
