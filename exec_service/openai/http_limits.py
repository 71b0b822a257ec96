"""What a client can make the HTTP server hold, bounded where uvicorn's httptools protocol leaves it open.

uvicorn bounds a body's buffer (it stops reading a connection past 64 KiB until the app takes what it has) but not a
request's head: httptools keeps a header's bytes until its line ends, and uvicorn the request line's, so one
connection sending an endless header grows the process without limit, before any token is checked. Nor does it
close a connection that sends nothing, or a head or body that never ends, or cap how many connections it serves.
Here, on every HTTP port Kiln serves (``kiln api-server``, ``kiln exec-server --openai-port``):

- a head (request line and headers) over ``max_head_bytes`` is answered 431 and its connection closed;
- a connection whose head is not complete ``head_timeout_s`` after it opened (or after the message began, for the
  next request on a kept-alive connection) is answered 408 and closed;
- past ``max_connections`` at once, a new connection is answered 503 and closed
  (these three: http_protocol.BoundedHttpToolsProtocol);
- a body not complete ``body_timeout_s`` after the app began to read it is 408, and the bodies held at once over all
  requests are at most ``buffered_bodies`` full-size ones (503 past that: body_limit.BodyLimit).

Refusals are OpenAI's error object, as every other answer of these ports.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 64 * 1024  # nginx's default is 4 buffers of 8 KiB; Kiln's own headers are under 5 KiB
    head_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096  # --max-http-connections
    buffered_bodies: int = 64  # bodies of max_request_bytes held at once, over all requests


DEFAULT_LIMITS = HttpLimits()
