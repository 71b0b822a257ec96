"""How tokens get from the engine thread to a Generate handler: outputs pushed onto the handler's asyncio queue."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kiln.errors import KilnError
from protos import exec_pb2


@dataclass
class RequestOutput:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = exec_pb2.FINISH_REASON_UNSPECIFIED  # set on the last output
    usage: exec_pb2.Usage | None = None  # set on the last output
    error: KilnError | None = None  # the request failed; nothing follows

    @property
    def is_last(self) -> bool:
        return self.finish_reason != exec_pb2.FINISH_REASON_UNSPECIFIED or self.error is not None


class RequestStream:
    """Written by the engine thread (``put``), read by one Generate handler on the event loop (``async for``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self._queue.get()
            yield output
            if output.is_last:
                return
