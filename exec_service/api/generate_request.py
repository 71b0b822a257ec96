"""A GenerateRequest checked at the edge: its prompt as token ids, its sampling params, its stop strings and its
number of sequences, every error naming its field. Every number's own range (temperature, top_p, penalties, n, ...)
was checked before the handler ran (kiln/rpc/field_bounds.py); here is what depends on the model or on other fields."""

import dataclasses

from exec_service.api.chat_prompt import chat_prompt
from exec_service.engine.sequence import SamplingParams
from kiln.errors import InvalidArgument, quote
from kiln.rpc.field_bounds import as_sent
from protos import exec_pb2

DEFAULT_MAX_TOKENS = 16
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
    temperature = as_sent(request.temperature) if request.HasField("temperature") else 1.0
    top_p = as_sent(request.top_p) if request.HasField("top_p") else 1.0
    for i, token in enumerate(request.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"stop_token_ids[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})")
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument("top_logprobs: needs logprobs set")
    penalties = {field: as_sent(getattr(request, field)) for field in ("presence_penalty", "frequency_penalty")}
    repetition = as_sent(request.repetition_penalty) if request.HasField("repetition_penalty") else 1.0
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
    return request.n or 1


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sequence ``index`` of n: a seed of its own, ``seed + index`` (wrapped to int64), so each
    sequence is reproducible and the same as a request for one with that seed."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index) % _INT64
    return dataclasses.replace(params, seed=seed - _INT64 if seed >= _INT64 // 2 else seed)
