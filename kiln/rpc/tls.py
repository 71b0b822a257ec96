"""TLS material as the servers and clients take it: PEM files read once at startup, turned into gRPC credentials.

A server presents ``--tls-cert``/``--tls-key`` and, with ``--tls-client-ca``, asks every client for a certificate
signed by that CA (mutual TLS). A client trusts ``--tls-ca`` and, for mutual TLS, presents
``--tls-client-cert``/``--tls-client-key``.
"""

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsFileError(ValueError):
    """A certificate or key file the operator named cannot be read; the message names it."""


def _read(path: str | Path, what: str) -> bytes:
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsFileError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsFileError(f"{what} {path}: not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTls:
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None  # set: mutual TLS, a client without a certificate from this CA is refused

    @classmethod
    def load(cls, cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> "ServerTls":
        return cls(_read(cert, "TLS certificate"), _read(key, "TLS key"),
                   _read(client_ca, "TLS client CA") if client_ca else None)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.mutual)


@dataclass(frozen=True)
class ClientTls:
    ca: bytes | None  # None: the system's roots
    cert_chain: bytes | None = None
    private_key: bytes | None = None

    @classmethod
    def load(cls, ca: str | Path | None, cert: str | Path | None = None,
             key: str | Path | None = None) -> "ClientTls":
        if bool(cert) != bool(key):
            raise TlsFileError("a TLS client certificate needs its key, and a key its certificate")
        return cls(_read(ca, "TLS CA") if ca else None, _read(cert, "TLS client certificate") if cert else None,
                   _read(key, "TLS client key") if key else None)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.cert_chain)
