"""How tokens get from the engine thread to a Generate handler: one event-loop wake-up per step, not per request."""

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from exec_service.engine.sequence import FinishReason, Usage
from kiln.errors import KilnError


@dataclass
class RequestOutput:
    """Tokens one step (or several, coalesced) added to a request; Python types only, the API edge makes the
    GenerateResponse."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set on the last output
    usage: Usage | None = None  # set on the last output
    error: KilnError | None = None  # the request failed; nothing follows

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """Written by the engine thread (``put``, ``deliver``), read by one Generate handler on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._pending: deque[RequestOutput] = deque()  # touched on the event loop only
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        deliver([(self, output)])

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in order; those already pending when the handler gets to them go out as one (a handler that
        fell behind a busy engine catches up in one message, not one per token)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                output = self._pending.popleft()
                while not output.is_last and self._pending and self._pending[0].error is None:
                    following = self._pending.popleft()
                    output = RequestOutput(output.token_ids + following.token_ids, following.finish_reason,
                                           following.usage)
                yield output
                if output.is_last:
                    return


def deliver(outputs: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Hand a step's outputs to their handlers with one wake-up of each event loop, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
    for stream, output in outputs:
        by_loop.setdefault(stream._loop, []).append((stream, output))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_enqueue, batch)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


def _enqueue(outputs: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in outputs:
        stream._pending.append(output)
        stream._ready.set()
