"""What a client presents to a Kiln server: the CA it trusts, its own certificate for mutual TLS, its bearer token.

Every client takes the same settings (the CLI, the execute service's channel to the compile service, ``kiln
health``, the benches), from flags or from ``KILN_TLS_CA``, ``KILN_TLS_CLIENT_CERT``, ``KILN_TLS_CLIENT_KEY`` and
``KILN_AUTH_TOKEN`` (or ``KILN_CLIENT_TOKEN_FILE``, a file holding it, for containers). The token rides in each
call's metadata as ``authorization: Bearer ...``.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kiln.rpc.auth import HEADER, SCHEME
from kiln.rpc.tls import ClientTls, TlsFileError


@dataclass(frozen=True)
class ClientSecurity:
    tls: ClientTls | None = None  # None: a plaintext channel
    token: str | None = None

    @classmethod
    def load(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
             token: str | None = None) -> "ClientSecurity":
        """From explicit settings, each missing one from the environment."""
        ca = ca or os.environ.get("KILN_TLS_CA") or None
        cert = cert or os.environ.get("KILN_TLS_CLIENT_CERT") or None
        key = key or os.environ.get("KILN_TLS_CLIENT_KEY") or None
        token = token or os.environ.get("KILN_AUTH_TOKEN") or _token_from_file(os.environ.get("KILN_CLIENT_TOKEN_FILE"))
        if (cert or key) and not ca:
            raise TlsFileError("a TLS client certificate needs --tls-ca (KILN_TLS_CA) too")
        return cls(ClientTls.load(ca, cert, key) if ca else None, token)

    def credentials(self) -> grpc.ChannelCredentials | None:
        return self.tls.credentials() if self.tls else None

    def interceptors(self) -> list:
        return [_TokenInterceptor(self.token)] if self.token else []

    def aio_interceptors(self) -> list:
        return [cls(self.token) for cls in _AIO_TOKEN_INTERCEPTORS] if self.token else []

    def channel(self, address: str, options: Sequence = ()) -> grpc.Channel:
        credentials = self.credentials()
        channel = (grpc.secure_channel(address, credentials, options=list(options)) if credentials
                   else grpc.insecure_channel(address, options=list(options)))
        return grpc.intercept_channel(channel, *self.interceptors())

    def aio_channel(self, address: str, options: Sequence = (), interceptors: Sequence = ()) -> grpc.aio.Channel:
        credentials = self.credentials()
        interceptors = [*self.aio_interceptors(), *interceptors] or None
        if credentials:
            return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


# A plaintext channel without a token: what reaches a loopback server that asks for neither.
PLAINTEXT = ClientSecurity()


def _token_from_file(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text().strip() or None
    except OSError as exc:
        raise TlsFileError(f"KILN_CLIENT_TOKEN_FILE {path}: {exc.strerror or exc}") from None


def _with_token(metadata, token: str) -> list:
    return [*(metadata or ()), (HEADER, SCHEME + token)]


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a blocking channel."""

    def __init__(self, token: str):
        self._token = token

    def _details(self, details):
        return _CallDetails(details, _with_token(details.metadata, self._token))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _AioToken:
    def __init__(self, token: str):
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(details.method, details.timeout,
                                          grpc.aio.Metadata(*_with_token(details.metadata, self._token)),
                                          details.credentials, details.wait_for_ready)


# grpc.aio picks an interceptor by the one kind it subclasses, so each call shape gets a class of its own.
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


_AIO_TOKEN_INTERCEPTORS = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
