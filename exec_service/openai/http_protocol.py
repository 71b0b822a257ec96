"""uvicorn's httptools protocol with the head's size and time bounded and the connections counted
(exec_service.openai.http_limits says why and which bounds)."""

import json
from asyncio import TimerHandle, Transport
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from exec_service.openai.errors import ApiError
from exec_service.openai.http_limits import HttpLimits

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that ends its connection, with OpenAI's error object as its body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(ApiError(status, message, kind, code=code).body()).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, REASONS[status], len(body))) + body


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """The protocol of one connection; uvicorn makes one per connection, with ``limits`` (and ``refused``, told each
    refusal's status: the gateway's request counter) bound in by the server."""

    def __init__(self, *args, limits: HttpLimits, refused: Callable[[int], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._on_refused = refused
        self._in_head = True  # every byte read since the last head ended, while this holds, is the next head's
        self._head_bytes = 0
        self._head_deadline: TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the server serves at most {self.limits.max_connections} connections at once "
                              "(--max-http-connections); retry later", "server_busy")
            return
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:  # a read that ends the head may carry the body's first bytes: judged after the parse
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_head_bytes and not self.transport.is_closing():
            self._refuse(431, f"the request's line and headers are over {self.limits.max_head_bytes} bytes",
                         "request_header_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_deadline is None:
            self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._cancel_head_deadline()
        super().on_headers_complete()

    def _arm_head_deadline(self) -> None:
        self._head_deadline = self.loop.call_later(self.limits.head_timeout_s, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self._refuse(408, f"no complete request line and headers within {self.limits.head_timeout_s:g} s",
                         "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._refused = True
        self._cancel_head_deadline()
        self.transport.write(refusal(status, message, code))
        self.transport.close()
        if self._on_refused is not None:
            self._on_refused(status)
