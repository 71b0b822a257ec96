"""The gateway's SSE response at the ASGI boundary: every event and the end of the body, the stream closed when the
client leaves (so the Generate calls behind it are cancelled), and a server's own cancellation not swallowed. The
ASGI ``receive``/``send`` pair is the protocol itself, driven here as uvicorn drives it; a client leaving a real
gateway is tests/test_openai_gateway.py's."""

import asyncio

import pytest

from exec_service.openai.streaming import MEDIA_TYPE, EventStream


class Events:
    """Yields ``items``, then waits forever unless ``finite``; says whether it was closed."""

    def __init__(self, items: list[bytes], finite: bool):
        self.items, self.finite, self.closed = items, finite, False
        self.sent_all = asyncio.Event()

    async def __call__(self):
        try:
            for item in self.items:
                yield item
            self.sent_all.set()
            if not self.finite:
                await asyncio.Event().wait()  # a sequence still waiting for its next token
        finally:
            self.closed = True


def run(events: Events, disconnect: asyncio.Event | None = None, cancel_after_all: bool = False):
    sent: list[dict] = []

    async def receive():
        if disconnect is None:
            await asyncio.Event().wait()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def main():
        task = asyncio.ensure_future(EventStream(events())({"type": "http"}, receive, send))
        await events.sent_all.wait()
        if disconnect is not None:
            disconnect.set()
        if cancel_after_all:
            task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        assert done, "the response did not end"
        task.result()

    asyncio.run(main())
    return sent


def test_every_event_then_the_end_of_the_body():
    events = Events([b"data: 1\n\n", b"data: [DONE]\n\n"], finite=True)
    sent = run(events)
    assert sent[0] == {"type": "http.response.start", "status": 200,
                       "headers": [(b"content-type", f"{MEDIA_TYPE}; charset=utf-8".encode())]}
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False] and events.closed


def test_a_client_leaving_closes_the_stream_and_ends_the_response_quietly():
    events = Events([b"data: 1\n\n"], finite=False)
    sent = run(events, disconnect=asyncio.Event())
    assert events.closed  # its finally ran: merged() cancels the Generate calls there
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]  # no end of body to a client that left


def test_the_servers_own_cancellation_is_not_swallowed():
    events = Events([b"data: 1\n\n"], finite=False)
    with pytest.raises(asyncio.CancelledError):
        run(events, cancel_after_all=True)
    assert events.closed
