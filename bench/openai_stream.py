"""A minimal streaming HTTP client for bench/serving.py's ``--backend openai``: POST a JSON body, read its
server-sent events as they arrive. HTTP/1.1 with h11 (uvicorn's own parser), connections kept alive and reused, as
vLLM's benchmark_serving does with aiohttp's pool, so a request's time is the gateway's and not a TCP handshake's."""

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import h11


class HttpError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)


class SseClient:
    def __init__(self, base_url: str, token: str | None = None):
        url = urlsplit(base_url)
        self.host, self.port, self.prefix = url.hostname, url.port or 80, url.path.rstrip("/")
        self.headers = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json")]
        if token:
            self.headers.append(("Authorization", f"Bearer {token}"))
        self._idle: list[_Connection] = []

    async def open(self, count: int) -> None:
        """Open ``count`` connections ahead of a timed run (a rate-inf run sends that many at once)."""
        for _ in range(count - len(self._idle)):
            self._idle.append(_Connection(*await asyncio.open_connection(self.host, self.port)))

    async def close(self) -> None:
        for connection in self._idle:
            connection.writer.close()
        self._idle.clear()

    async def _connection(self) -> _Connection:
        """An idle connection the server has not closed (uvicorn closes one idle past its keep-alive timeout, 5 s),
        or a new one."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.reader.at_eof():
                return connection
            connection.writer.close()
        return _Connection(*await asyncio.open_connection(self.host, self.port))

    async def events(self, path: str, body: dict) -> AsyncIterator[dict]:
        """The ``data:`` payloads of the answer to ``POST path``, as JSON, until ``[DONE]``."""
        connection = await self._connection()
        data = json.dumps(body).encode()
        conn = connection.h11
        connection.writer.write(conn.send(h11.Request(method="POST", target=self.prefix + path,
                                                      headers=[*self.headers, ("Content-Length", str(len(data)))])))
        connection.writer.write(conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        await connection.writer.drain()
        buffer = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await connection.reader.read(1 << 16))
            elif isinstance(event, h11.Response) and event.status_code != 200:
                connection.writer.close()  # its answer unread: not one to reuse
                raise HttpError(event.status_code, f"POST {path}: HTTP {event.status_code}")
            elif isinstance(event, h11.Data):
                buffer += event.data
                while b"\n\n" in buffer:
                    line, buffer = buffer.split(b"\n\n", 1)
                    payload = line.removeprefix(b"data: ")
                    if payload != b"[DONE]":
                        yield json.loads(payload)
            elif isinstance(event, h11.EndOfMessage):
                break
        conn.start_next_cycle()
        self._idle.append(connection)
