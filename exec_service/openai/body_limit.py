"""A cap on request bodies, before anything parses them: uvicorn reads whatever a client sends, and FastAPI holds a
body whole in memory while it validates it. Over the cap is 413 with OpenAI's error object, whether the body
announced its length or came in chunks."""

import json

from exec_service.openai.errors import ApiError


class BodyLimit:
    """Plain ASGI middleware: reads the body up to ``max_bytes``, then hands it to the app as one message."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # after the body: the disconnect a streamed answer listens for
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        error = ApiError(413, f"the request body is over {self.max_bytes} bytes (--max-request-bytes)")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
