"""A GenerateRequest checked at the edge: its prompt as token ids and its sampling params, errors naming fields."""

import math
import struct

from exec_service.engine.sequence import SamplingParams
from kiln.errors import InvalidArgument
from protos import exec_pb2

DEFAULT_MAX_TOKENS = 16


def prompt_token_ids(request: exec_pb2.GenerateRequest, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    if request.prompt and request.prompt_ids:
        raise InvalidArgument("prompt: set exactly one of prompt and prompt_ids, not both")
    if request.prompt:
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
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=request.top_k,
        seed=request.seed if request.HasField("seed") else None, stop_token_ids=frozenset(request.stop_token_ids),
        ignore_eos=request.ignore_eos)


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
