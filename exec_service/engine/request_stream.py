"""How tokens get from the engine thread to a Generate handler: one event-loop wake-up per step, not per request."""

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from exec_service.engine.sampler import TokenLogprobs
from exec_service.engine.sequence import FinishReason, Usage
from kiln.errors import KilnError


@dataclass
class RequestOutput:
    """Tokens one step (or several, coalesced) added to one sequence of a request; Python types only, the API edge
    makes the GenerateResponse."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set on the sequence's last output
    usage: Usage | None = None  # set on the sequence's last output
    error: KilnError | None = None  # the request failed; nothing follows
    index: int = 0  # which of the request's sequences
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def then(self, following: "RequestOutput") -> "RequestOutput":
        """This output and the same sequence's next one as one."""
        logprobs = None if self.logprobs is None else self.logprobs + (following.logprobs or [])
        return RequestOutput(self.token_ids + following.token_ids, following.finish_reason, following.usage,
                             index=self.index, logprobs=logprobs)


class RequestStream:
    """Written by the engine thread (``put``, ``deliver``), read by one Generate handler on the event loop: the
    outputs of a request's ``num_sequences`` sequences, until each has had its last one or one is an error."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_sequences: int = 1):
        self._loop = loop
        self._pending: deque[RequestOutput] = deque()  # touched on the event loop only
        self._ready = asyncio.Event()
        self._live = num_sequences

    def put(self, output: RequestOutput) -> None:
        deliver([(self, output)])

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in order for each sequence; those already pending when the handler gets to them go out as one per
        sequence (a handler that fell behind a busy engine catches up in one message, not one per token)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            coalesced: dict[int, RequestOutput] = {}
            while self._pending and self._pending[0].error is None:
                output = self._pending.popleft()
                earlier = coalesced.get(output.index)
                coalesced[output.index] = output if earlier is None else earlier.then(output)
            error = self._pending.popleft() if self._pending else None  # the request ends with it
            for output in coalesced.values():
                yield output
                self._live -= output.is_last
            if error is not None:
                yield error
                return
            if self._live <= 0:
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
