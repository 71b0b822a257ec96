"""``kiln api-server``: the OpenAI-compatible HTTP gateway in front of one or more execute services."""

import ipaddress
import os

from kiln.rpc.grpc_server import DEFAULT_MAX_REQUEST_BYTES, host_of
from kiln_cli import metrics_args, security_args
from kiln_cli.compile_commands import add_shutdown_grace_arg


def register(subparsers) -> None:
    p = subparsers.add_parser("api-server", help="run the OpenAI-compatible HTTP gateway")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port to listen on")
    p.add_argument("--exec-server", action="append", default=None, metavar="TARGET",
                   help="execute services, balanced round-robin: HOST:PORT (repeatable, IP addresses), or one gRPC "
                        "target such as dns:///exec:50052 (every address the name resolves to: a Kubernetes "
                        "headless Service) or ipv4:10.0.0.1:50052,10.0.0.2:50052 (env KILN_EXEC_SERVER)")
    p.add_argument("--tls-server-name", default=os.environ.get("KILN_TLS_SERVER_NAME"),
                   help="the name in the execute services' certificate, where the target does not carry it")
    p.add_argument("--https-cert", default=os.environ.get("KILN_HTTPS_CERT"), help="serve HTTPS: certificate (PEM)")
    p.add_argument("--https-key", default=os.environ.get("KILN_HTTPS_KEY"), help="its private key (PEM)")
    p.add_argument("--max-request-bytes", type=int,
                   default=int(os.environ.get("KILN_MAX_REQUEST_BYTES") or DEFAULT_MAX_REQUEST_BYTES),
                   help="largest request body accepted; larger is 413 (default: %(default)s)")
    security_args.add_http_args(p)
    metrics_args.add_metrics_arg(p)
    add_shutdown_grace_arg(p)
    security_args.add_client_args(p)  # towards the execute services; tokens are the HTTP clients' own
    p.set_defaults(handler=run_api_server)


def exec_target(addresses: list[str]) -> str:
    """One gRPC target for the addresses: itself if one, ``ipv4:a,b`` (or ``ipv6:``) for several IP addresses."""
    if len(addresses) == 1:
        return addresses[0]
    try:
        versions = {ipaddress.ip_address(host_of(a).strip("[]")).version for a in addresses}
    except ValueError:
        raise ValueError("--exec-server: several addresses must be IP addresses (HOST:PORT); for replicas by name "
                         "give one DNS target, e.g. dns:///exec:50052") from None
    if len(versions) > 1:
        raise ValueError("--exec-server: mix of IPv4 and IPv6 addresses; give one family")
    return f"ipv{versions.pop()}:{','.join(addresses)}"


def run_api_server(args) -> int:
    from exec_service.openai.gateway_metrics import GatewayMetrics
    from exec_service.openai.server import ApiServer, ApiServerSettings
    from tracing.setup import init_tracing

    addresses = args.exec_server or [a for a in (os.environ.get("KILN_EXEC_SERVER") or "").split(",") if a]
    if not addresses:
        return security_args.refuse_setting(ValueError("--exec-server: name the execute service(s) to forward to"))
    if bool(args.https_cert) != bool(args.https_key):
        return security_args.refuse_setting(ValueError("--https-cert and --https-key go together"))
    try:
        target = exec_target(addresses)
        cors = security_args.cors_origins(args)
    except ValueError as exc:
        return security_args.refuse_setting(exc)
    tls = security_args.client_security(args).tls  # the token each call carries is its HTTP client's
    telemetry = init_tracing("kiln-api")
    metrics = metrics_args.start_metrics(args, GatewayMetrics)
    settings = ApiServerSettings(args.host, args.port, target, tls, args.tls_server_name, args.https_cert,
                                 args.https_key, args.shutdown_grace_s, args.max_request_bytes,
                                 security_args.http_limits(args), cors)
    try:
        ApiServer(settings, metrics.collector if metrics else None).run()
    finally:
        if metrics:
            metrics.close()
        telemetry.shutdown()
    return 0
