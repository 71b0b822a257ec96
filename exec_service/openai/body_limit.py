"""A cap on request bodies, before anything parses them: uvicorn reads whatever a client sends, and the app holds a
body whole in memory while it validates it. Over the cap is 413 with OpenAI's error object, whether the body
announced its length or came in chunks; a body that does not arrive within its time is 408; and the bodies held at
once by every request in flight share one budget, past which a request is 503 (exec_service.openai.http_limits)."""

import asyncio
import json

from exec_service.openai.errors import ApiError


class BodyLimit:
    """Plain ASGI middleware: reads the body up to ``max_bytes`` within ``timeout_s``, then hands it to the app as
    one message; the body counts against ``budget_bytes`` until the app's answer ends."""

    def __init__(self, app, max_bytes: int, timeout_s: float, budget_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # over every request's body, read or being read (one event loop: no lock)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _refuse(send, ApiError(413, f"the request body is over {self.max_bytes} bytes "
                                                     "(--max-request-bytes)"))
        held = 0  # this request's bytes in held_bytes, given back when its answer ends or it is refused
        try:
            chunks = []
            try:
                async with asyncio.timeout(self.timeout_s):
                    while True:
                        message = await receive()
                        if message["type"] != "http.request":  # the client left before its body ended
                            return
                        chunk = message.get("body", b"")
                        if held + len(chunk) > self.max_bytes:
                            return await _refuse(send, ApiError(413, f"the request body is over {self.max_bytes} "
                                                                     "bytes (--max-request-bytes)"))
                        if self.held_bytes + len(chunk) > self.budget_bytes:
                            return await _refuse(send, ApiError(
                                503, f"the server holds {self.held_bytes} bytes of request bodies, its budget is "
                                     f"{self.budget_bytes}; retry later", "server_error", code="server_busy"))
                        held += len(chunk)
                        self.held_bytes += len(chunk)
                        chunks.append(chunk)
                        if not message.get("more_body"):
                            break
            except TimeoutError:
                return await _refuse(send, ApiError(
                    408, f"the request body did not arrive within {self.timeout_s:g} s", code="request_timeout"))
            body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

            async def replay():
                nonlocal body
                if body is None:
                    return await receive()  # after the body: the disconnect a streamed answer listens for
                message, body = body, None
                return message

            await self.app(scope, replay, send)
        finally:
            self.held_bytes -= held


async def _refuse(send, error: ApiError) -> None:
    """The error as the whole answer, closing the connection: the rest of a refused body is never read."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
