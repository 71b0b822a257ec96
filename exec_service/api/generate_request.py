"""A GenerateRequest checked at the edge: its prompt as token ids, its sampling params, its stop strings and its
number of sequences, every error naming its field."""

import dataclasses
import math
import struct

from exec_service.api.chat_prompt import chat_prompt
from exec_service.engine.sequence import SamplingParams
from kiln.errors import InvalidArgument, quote
from protos import exec_pb2

DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty in [-2, 2], as OpenAI's
MAX_REPETITION_PENALTY = 10.0
MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
_INT64 = 1 << 64


def prompt_token_ids(request: exec_pb2.GenerateRequest, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    given = [name for name, present in (("prompt", bool(request.prompt)), ("prompt_ids", bool(request.prompt_ids)),
                                        ("messages", bool(request.messages))) if present]
    if len(given) > 1:
        raise InvalidArgument(f"{given[0]}: set exactly one of prompt, prompt_ids and messages, not "
                              f"{' and '.join(given)}")
    if request.messages:
        text = chat_prompt(request.messages, tokenizer, request.model, max_model_len)
        ids = list(tokenizer.encode(text, add_special_tokens=False))  # the template writes the special tokens
        field = "messages"
    elif request.prompt:
        if tokenizer is None:
            raise InvalidArgument(f"prompt: model {request.model!r} has no tokenizer; send prompt_ids")
        ids = list(tokenizer.encode(request.prompt))
        field = "prompt"
    else:
        ids = list(request.prompt_ids)
        field = "prompt_ids"
    if not ids:
        raise InvalidArgument(f"{field}: the prompt is empty")
    if len(ids) >= max_model_len:
        raise InvalidArgument(f"{field}: {len(ids)} tokens leave no room to generate within max_model_len "
                              f"{max_model_len}")
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{field}[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})")
    return ids


def sampling_params(request: exec_pb2.GenerateRequest, vocab_size: int) -> SamplingParams:
    max_tokens = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens <= 0:
        raise InvalidArgument(f"max_tokens: {max_tokens} must be positive")
    temperature = as_sent(request.temperature) if request.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidArgument(f"temperature: {temperature} must be a finite number >= 0")
    top_p = as_sent(request.top_p) if request.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"top_p: {top_p} is outside (0, 1]")
    if request.top_k < 0:
        raise InvalidArgument(f"top_k: {request.top_k} must be >= 0 (0 keeps every token)")
    for i, token in enumerate(request.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"stop_token_ids[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: {request.top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]")
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument("top_logprobs: needs logprobs set")
    penalties = {}
    for field in ("presence_penalty", "frequency_penalty"):
        penalties[field] = as_sent(getattr(request, field))
        if not -MAX_PENALTY <= penalties[field] <= MAX_PENALTY:
            raise InvalidArgument(f"{field}: {penalties[field]} is outside [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
    repetition = as_sent(request.repetition_penalty) if request.HasField("repetition_penalty") else 1.0
    if not 0 < repetition <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(f"repetition_penalty: {repetition} is outside (0, {MAX_REPETITION_PENALTY:g}] (1 "
                              f"leaves the logits as they are)")
    if not 0 <= request.min_tokens <= max_tokens:
        raise InvalidArgument(f"min_tokens: {request.min_tokens} is outside [0, max_tokens {max_tokens}]")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=request.top_k,
        seed=request.seed if request.HasField("seed") else None, stop_token_ids=frozenset(request.stop_token_ids),
        ignore_eos=request.ignore_eos, repetition_penalty=repetition, min_tokens=request.min_tokens,
        logprobs=request.logprobs, top_logprobs=request.top_logprobs, **penalties)


def stop_strings(request: exec_pb2.GenerateRequest, tokenizer) -> tuple[str, ...]:
    if request.stop and tokenizer is None:
        raise InvalidArgument(f"stop: model {request.model!r} has no tokenizer, so no text to match; send "
                              f"stop_token_ids")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop: {len(request.stop)} strings, more than {MAX_STOP_STRINGS}")
    for i, text in enumerate(request.stop):
        if not 0 < len(text) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}]: {quote(text)} must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(request.stop)


def num_sequences(request: exec_pb2.GenerateRequest) -> int:
    if not 0 <= request.n <= MAX_N:
        raise InvalidArgument(f"n: {request.n} is outside [0, {MAX_N}] (0 means 1)")
    return request.n or 1


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sequence ``index`` of n: a seed of its own, ``seed + index`` (wrapped to int64), so each
    sequence is reproducible and the same as a request for one with that seed."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index) % _INT64
    return dataclasses.replace(params, seed=seed - _INT64 if seed >= _INT64 // 2 else seed)


def as_sent(value: float) -> float:
    """A proto ``float`` as the client wrote it: the shortest decimal with the same float32 (0.8, not the
    0.800000011920929 that float32 widens to), so sampling, spans and logs all see the number that was sent."""
    if not math.isfinite(value):
        return value
    for digits in range(1, 10):
        shortest = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", shortest))[0] == value:
            return shortest
    return value
