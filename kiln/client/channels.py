"""Channels to a Kiln server with Kiln's options (message sizes, keepalive), TLS and the bearer token of
``security`` (flags or ``KILN_TLS_CA``, ``KILN_AUTH_TOKEN``, ...: kiln.rpc.client_security)."""

from collections.abc import Sequence

import grpc

from kiln.rpc.client_security import PLAINTEXT, ClientSecurity
from kiln.rpc.grpc_server import CHANNEL_OPTIONS


def connect(address: str, security: ClientSecurity = PLAINTEXT) -> grpc.Channel:
    """A blocking channel to ``address`` (host:port)."""
    return security.channel(address, CHANNEL_OPTIONS)


def connect_aio(address: str, security: ClientSecurity = PLAINTEXT, interceptors: Sequence = ()) -> grpc.aio.Channel:
    """An asyncio channel; ``interceptors`` run after the token's (tracing's client spans, for one)."""
    return security.aio_channel(address, CHANNEL_OPTIONS, interceptors)
