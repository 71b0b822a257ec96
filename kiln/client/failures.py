"""A failed call in words a person can act on: the status gRPC gave, and what it means at a Kiln address.

gRPC's own words are terse where a newcomer trips: the other service's port answers ``UNIMPLEMENTED: Method not
found!``, and a TLS server reached in plaintext closes the socket, which reads as if nothing listened. The health
service (open to every client, token or not) says which Kiln service answers, and a TLS handshake tried with the
standard library says whether the server speaks TLS.
"""

import re
import socket
import ssl

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.rpc.client_security import ClientSecurity
from protos import compile_pb2, exec_pb2

COMPILE_SERVICE = compile_pb2.DESCRIPTOR.services_by_name["CompileService"].full_name
EXEC_SERVICE = exec_pb2.DESCRIPTOR.services_by_name["ExecService"].full_name
SERVICE_WORDS = {COMPILE_SERVICE: "compile service", EXEC_SERVICE: "execute service"}
PROBE_S = 2.0


def explain(exc: grpc.RpcError, address: str, security: ClientSecurity, service: str, method: str) -> str:
    """``STATUS: what happened`` for a call of ``service``'s ``method`` at ``address`` that failed with ``exc``."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        answering = kiln_service_at(address, security)
        if answering and answering != service:
            return (f"{code.name}: this is a Kiln {SERVICE_WORDS[answering]}; {method} is on the "
                    f"{SERVICE_WORDS[service]}")
        return f"{code.name}: {address} has no {method} ({details}): is it a Kiln {SERVICE_WORDS[service]}?"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{code.name}: {unreachable(details, address, security)}"
    return f"{code.name}: {details or 'no details'}"


def unreachable(details: str, address: str, security: ClientSecurity) -> str:
    """Why nothing answered at ``address``: a TLS handshake that failed, a TLS server reached in plaintext, or no
    server at all; ``details`` are gRPC's words for the UNAVAILABLE."""
    if "handshake failed" in details.lower():
        reason = re.search(r"OPENSSL_internal:([A-Z_]+)", details)
        reason = reason.group(1) if reason else details.rsplit("handshake failed", 1)[-1].strip(" :")
        return (f"TLS handshake with {address} failed ({reason}): is --tls-ca (KILN_TLS_CA) the CA that signed the "
                f"server's certificate, and does the server use TLS?")
    if security.tls is None and speaks_tls(address):
        return (f"TLS handshake failure: {address} speaks TLS and this client does not: pass --tls-ca FILE (or "
                f"KILN_TLS_CA), the CA of the server's certificate")
    return f"nothing answers at {address} ({details})"


def kiln_service_at(address: str, security: ClientSecurity) -> str | None:
    """The Kiln service the server at ``address`` says it serves, through the health service; None if neither."""
    with security.channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in SERVICE_WORDS:
            try:
                health.Check(health_pb2.HealthCheckRequest(service=name), timeout=PROBE_S)
                return name
            except grpc.RpcError:
                continue
    return None


def speaks_tls(address: str) -> bool:
    """Whether a TLS handshake (not verified: only the protocol is in question) succeeds at ``address``."""
    host, _, port = address.removeprefix("dns:///").rpartition(":")
    host = host.strip("[]") or "localhost"
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_S) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False
