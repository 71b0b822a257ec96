"""``kiln health ADDR``: one standard gRPC health Check; exit 0 when SERVING, 1 otherwise (compose healthchecks)."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.client.failures import unreachable
from kiln.rpc.client_security import PLAINTEXT, ClientSecurity
from kiln_cli import security_args
from kiln_cli.arguments import add_server_address

SERVING = "SERVING"


def register(subparsers) -> None:
    p = subparsers.add_parser("health", help="check a server through the gRPC health service (exit 0 when SERVING)")
    add_server_address(p, None, "compile or execute service")
    p.add_argument("--service", default="",
                   help="name to check: '' is the whole server (default), kiln.v1.ExecService/<model> one model")
    p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for an answer (default: %(default)s)")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_health)


def check(address: str, service: str = "", timeout: float = 5.0, client: ClientSecurity = PLAINTEXT) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...); raises grpc.RpcError when there is no answer."""
    with client.channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def run_health(args) -> int:
    what = f"{args.server} service {args.service!r}" if args.service else args.server
    security = security_args.client_security(args)
    try:
        status = check(args.server, args.service, args.timeout, security)
    except grpc.RpcError as exc:
        print(f"error: {what}: {exc.code().name}: {_reason(exc, args.server, security)}", file=sys.stderr)
        return 1
    if status != SERVING:
        print(f"error: {what}: {status}", file=sys.stderr)
        return 1
    print(f"{what}: {status}")
    return 0


def _reason(exc: grpc.RpcError, address: str, security: ClientSecurity) -> str:
    """The health service's own words for the usual failures, which gRPC's details leave terse."""
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return "the server does not know this service name (is the model loaded?)"
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return unreachable(exc.details() or "", address, security)
    return exc.details() or "no details"


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value
