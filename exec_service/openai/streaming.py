"""Streamed answers as server-sent events: one ``data: {chunk}`` per GenerateResponse, then ``data: [DONE]``.

Chunks are OpenAI's ``text_completion`` and ``chat.completion.chunk`` objects; a chat choice's first chunk carries
the assistant role, its last the finish reason. With ``stream_options.include_usage`` a last chunk with no choices
carries the usage. A failure after the first event can no longer change the HTTP status, so it arrives as an
event holding OpenAI's error object (what OpenAI's clients raise from), followed by ``[DONE]``.
"""

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from exec_service.openai.errors import from_rpc_error
from exec_service.openai.responses import (
    FINISH_REASONS,
    UsageCount,
    chat_logprobs,
    completion_id,
    completion_logprobs,
    now,
)
from protos import exec_pb2

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps would build one per event


def event(data: dict) -> bytes:
    return b"data: " + _ENCODE(data).encode() + b"\n\n"


class ChunkStream:
    """Turns (prompt index, GenerateResponse) pairs into the SSE events of one streamed request."""

    def __init__(self, n: int, chat: bool, model: str, want_logprobs: bool, include_usage: bool,
                 want_token_ids: bool = False):
        self.n = n
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.want_token_ids = want_token_ids
        self.include_usage = include_usage
        self.usage = UsageCount()
        self._offsets: dict[int, int] = {}  # choice -> characters sent: the next token's text_offset
        self._head = {"id": completion_id("chatcmpl" if chat else "cmpl"),
                      "object": "chat.completion.chunk" if chat else "text_completion", "created": now(),
                      "model": model}

    def chunk(self, prompt: int, response: exec_pb2.GenerateResponse) -> bytes:
        index = prompt * self.n + response.index
        self.usage.add(prompt, response)
        finish_reason = FINISH_REASONS.get(response.finish_reason)
        choice: dict = {"index": index}
        if self.chat:
            delta = {"content": response.text} if response.text or response.token_ids else {}
            if index not in self._offsets:
                delta = {"role": "assistant", "content": response.text}
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(response.logprobs) if self.want_logprobs else None
        else:
            choice["text"] = response.text
            choice["logprobs"] = (completion_logprobs(response.logprobs, self._offsets.get(index, 0))
                                  if self.want_logprobs else None)
        self._offsets[index] = self._offsets.get(index, 0) + len(response.text)
        choice["finish_reason"] = finish_reason
        if self.want_token_ids:
            choice["token_ids"] = list(response.token_ids)
        return event({**self._head, "choices": [choice]})

    def usage_chunk(self) -> bytes:
        return event({**self._head, "choices": [], "usage": self.usage.body()})

    async def events(self, first: tuple[int, exec_pb2.GenerateResponse],
                     rest: AsyncIterator[tuple[int, exec_pb2.GenerateResponse]]) -> AsyncIterator[bytes]:
        """Every event of the answer: ``first`` (already received, so the HTTP status was known), then ``rest``."""
        yield self.chunk(*first)
        try:
            async for prompt, response in rest:
                yield self.chunk(prompt, response)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            log.info("stream ended early: %d %s", error.status, error.message)
            yield event(error.body())
            yield DONE
            return
        if self.include_usage:
            yield self.usage_chunk()
        yield DONE


class EventStream(Response):
    """An ASGI response sending ``events`` as they come, and cancelling them when the client disconnects.

    Starlette's StreamingResponse does the same through an anyio task group of two tasks per response, on servers
    that speak ASGI 2.3 as uvicorn does; that cost ~0.1 ms of a request's first token (bench/gateway_overhead.py).
    Here one watcher task waits for the disconnect and cancels the sending task, whose iterator's ``finally``
    cancels the Generate calls."""

    def __init__(self, events: AsyncGenerator[bytes, None]):
        # Not Response.__init__: with no body it would announce a content-length of 0.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", f"{MEDIA_TYPE}; charset=utf-8".encode())]
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.current_task()
        left = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()
            sender.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for item in self.events:
                await send({"type": "http.response.body", "body": item, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left.is_set():
                raise  # the server's own cancellation (shutdown), not the client leaving
            sender.uncancel()
        finally:
            watcher.cancel()
            await self.events.aclose()
