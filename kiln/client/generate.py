"""Generate as a stream: the responses as they come, with what they add up to (tokens, text, usage, finish)."""

from collections.abc import AsyncIterator, Iterator

from protos import exec_pb2


class Generation:
    """One Generate call. Iterate it (``for`` on a blocking stub, ``async for`` on a grpc.aio one) to see each
    response as it streams; ``token_ids``, ``text``, ``usage`` and ``finish_reason`` add up what has come so far.
    ``cancel()`` ends the call; the server frees what the request held."""

    def __init__(self, stub, request: exec_pb2.GenerateRequest, timeout: float | None = None):
        self.call = stub.Generate(request, timeout=timeout)
        self.token_ids: list[int] = []
        self.text = ""
        self.usage = exec_pb2.Usage()
        self.finish_reason = exec_pb2.FINISH_REASON_UNSPECIFIED

    def _add(self, response: exec_pb2.GenerateResponse) -> exec_pb2.GenerateResponse:
        self.token_ids.extend(response.token_ids)
        self.text += response.text
        if response.HasField("usage"):
            self.usage = response.usage
        if response.finish_reason:
            self.finish_reason = response.finish_reason
        return response

    def __iter__(self) -> Iterator[exec_pb2.GenerateResponse]:
        for response in self.call:
            yield self._add(response)

    async def __aiter__(self) -> AsyncIterator[exec_pb2.GenerateResponse]:
        async for response in self.call:
            yield self._add(response)

    def cancel(self) -> None:
        self.call.cancel()


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
