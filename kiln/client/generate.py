"""Generate as a stream: the responses as they come, with what they add up to per sequence (tokens, text,
logprobs, usage, finish reason)."""

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from protos import exec_pb2


@dataclass
class SequenceOutput:
    """One of a request's ``n`` sequences, as far as it has streamed."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)  # exec_pb2.TokenLogprob, one per token when asked for
    usage: exec_pb2.Usage = field(default_factory=exec_pb2.Usage)
    finish_reason: int = exec_pb2.FINISH_REASON_UNSPECIFIED  # set once the sequence has ended


class Generation:
    """One Generate call. Iterate it (``for`` on a blocking stub, ``async for`` on a grpc.aio one) to see each
    response as it streams; ``sequences[i]`` adds up what has come of sequence ``i`` so far, and ``token_ids``,
    ``text``, ``usage`` and ``finish_reason`` are sequence 0's (the only one when n is 1). ``cancel()`` ends the
    call; the server frees what the request held."""

    def __init__(self, stub, request: exec_pb2.GenerateRequest, timeout: float | None = None):
        self.call = stub.Generate(request, timeout=timeout)
        self.sequences: dict[int, SequenceOutput] = {}

    def _add(self, response: exec_pb2.GenerateResponse) -> exec_pb2.GenerateResponse:
        sequence = self.sequences.setdefault(response.index, SequenceOutput())
        sequence.token_ids.extend(response.token_ids)
        sequence.text += response.text
        sequence.logprobs.extend(response.logprobs)
        if response.HasField("usage"):
            sequence.usage = response.usage
        if response.finish_reason:
            sequence.finish_reason = response.finish_reason
        return response

    def __iter__(self) -> Iterator[exec_pb2.GenerateResponse]:
        for response in self.call:
            yield self._add(response)

    async def __aiter__(self) -> AsyncIterator[exec_pb2.GenerateResponse]:
        async for response in self.call:
            yield self._add(response)

    def cancel(self) -> None:
        self.call.cancel()

    @property
    def first(self) -> SequenceOutput:
        return self.sequences.get(0) or SequenceOutput()

    @property
    def token_ids(self) -> list[int]:
        return self.first.token_ids

    @property
    def text(self) -> str:
        return self.first.text

    @property
    def usage(self) -> exec_pb2.Usage:
        return self.first.usage

    @property
    def finish_reason(self) -> int:
        return self.first.finish_reason


def generate(stub, request: exec_pb2.GenerateRequest, timeout: float | None = None) -> Generation:
    """Generate to the end on a blocking stub; the whole generation."""
    generation = Generation(stub, request, timeout)
    for _ in generation:
        pass
    return generation


async def generate_async(stub, request: exec_pb2.GenerateRequest, timeout: float | None = None) -> Generation:
    """generate on a grpc.aio stub."""
    generation = Generation(stub, request, timeout)
    async for _ in generation:
        pass
    return generation
