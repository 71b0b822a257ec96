"""The security flags, the same on every command that has them: servers' TLS, tokens, request cap, model roots and
Hugging Face cache, clients' CA, certificate and token. Each flag falls back to its ``KILN_*`` environment variable
(the cache to Hugging Face's own, HF_HUB_CACHE or HF_HOME)."""

import argparse
import os
import re
import sys
from pathlib import Path

from exec_service.openai.http_limits import HttpLimits
from kiln.model.hub import HubCache
from kiln.rpc.auth import TokenFileError, TokenTable
from kiln.rpc.client_security import ClientSecurity
from kiln.rpc.grpc_server import DEFAULT_HOST, DEFAULT_MAX_REQUEST_BYTES, ServerSecurity
from kiln.rpc.tls import ServerTls, TlsFileError
from kiln.store.signing import KeyFileError
from kiln_cli.arguments import CLIENT_ENVIRONMENT, SERVER_ENVIRONMENT

# A web origin: scheme, host (a name or an IPv4 address, or an IPv6 one in brackets), an optional port.
_ORIGIN = re.compile(r"https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")
# What a refused key, certificate or token file raises: the command prints it and exits 2.
SETTING_ERRORS = (KeyFileError, TlsFileError, TokenFileError)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The TLS, token and bound flags of a server command; its help lists their environment variables."""
    p.epilog = SERVER_ENVIRONMENT
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="interface to bind (default: %(default)s; anything else warns unless TLS and tokens are on)")
    p.add_argument("--tls-cert", default=os.environ.get("KILN_TLS_CERT"), help="server certificate chain (PEM)")
    p.add_argument("--tls-key", default=os.environ.get("KILN_TLS_KEY"), help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default=os.environ.get("KILN_TLS_CLIENT_CA"),
                   help="CA for client certificates: mutual TLS, a client without one is refused")
    p.add_argument("--auth-token-file", default=os.environ.get("KILN_AUTH_TOKEN_FILE"),
                   help="tokens a client must send, one 'ROLE TOKEN' per line (ROLE: admin or user)")
    p.add_argument("--max-request-bytes", type=int,
                   default=int(os.environ.get("KILN_MAX_REQUEST_BYTES") or DEFAULT_MAX_REQUEST_BYTES),
                   help="largest request message accepted (default: %(default)s)")
    p.add_argument("--model-root", action="append", default=None,
                   help="directory under which clients may name models and weights (repeatable; "
                        "env KILN_MODEL_ROOTS, separated by ':')")
    p.add_argument("--hub-cache", default=None,
                   help="the Hugging Face cache Hub ids (org/name[@revision]) resolve in, a model root too "
                        "(default: Hugging Face's, HF_HUB_CACHE); 'none' refuses Hub ids")
    p.add_argument("--allow-hub-downloads", action="store_true",
                   default=os.environ.get("KILN_ALLOW_HUB_DOWNLOADS") == "1",
                   help="download a Hub id missing from the cache (configs, safetensors, tokenizers; never code). "
                        "Off by default: with it, any client that may load or compile makes this server fetch the "
                        "repositories it names (env KILN_ALLOW_HUB_DOWNLOADS=1)")


def add_http_args(p: argparse.ArgumentParser) -> None:
    """What an HTTP port's operator sets (kiln api-server, kiln exec-server --openai-port): the connection bound (the
    others are exec_service.openai.http_limits's) and the web origins whose pages may call it."""
    p.add_argument("--max-http-connections", type=_connection_count,
                   default=os.environ.get("KILN_MAX_HTTP_CONNECTIONS") or str(HttpLimits.max_connections),
                   help="connections the HTTP port serves at once; one past them is answered 503 and closed "
                        "(env KILN_MAX_HTTP_CONNECTIONS)")
    p.add_argument("--cors-allow-origin", dest="cors_origins", action="append", type=_origin, metavar="ORIGIN",
                   help="let a web page from ORIGIN (scheme://host[:port], or * for any) call the HTTP API from a "
                        "browser, bearer token included (repeatable; env KILN_CORS_ALLOW_ORIGINS, comma-separated; "
                        "default: none, same-origin only)")


def http_limits(args) -> HttpLimits:
    return HttpLimits(max_connections=args.max_http_connections)


def cors_origins(args) -> tuple[str, ...]:
    """The flag's origins, else the environment's; ValueError for one the environment gives wrong."""
    if args.cors_origins:
        return tuple(args.cors_origins)
    try:
        return tuple(_origin(o.strip()) for o in (os.environ.get("KILN_CORS_ALLOW_ORIGINS") or "").split(",")
                     if o.strip())
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"KILN_CORS_ALLOW_ORIGINS: {exc}") from None


def _origin(text: str) -> str:
    """A CORS origin as browsers send it: ``*``, or scheme://host[:port] with nothing after."""
    if text == "*" or _ORIGIN.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(f"must be * or scheme://host[:port] (no path, no trailing /), got {text!r}")


def _connection_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be a count in [1, 1000000], got {text!r}")
    return int(text)


def add_client_args(p: argparse.ArgumentParser) -> None:
    """The TLS flags of a client command; its help lists the environment variables (the token among them)."""
    p.epilog = "\n\n".join(filter(None, [p.epilog, CLIENT_ENVIRONMENT]))
    p.add_argument("--tls-ca", default=None, help="CA of the server's certificate: use TLS (env KILN_TLS_CA)")
    p.add_argument("--tls-client-cert", default=None,
                   help="client certificate for mutual TLS (env KILN_TLS_CLIENT_CERT)")
    p.add_argument("--tls-client-key", default=None, help="its private key (env KILN_TLS_CLIENT_KEY)")


def server_security(args) -> ServerSecurity:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise TlsFileError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise TlsFileError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = ServerTls.load(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    tokens = TokenTable.load(args.auth_token_file) if args.auth_token_file else None
    return ServerSecurity(tls, tokens, args.max_request_bytes)


def model_roots(args) -> list[str]:
    if args.model_root:
        return args.model_root
    return [root for root in (os.environ.get("KILN_MODEL_ROOTS") or "").split(os.pathsep) if root]


def hub_cache(args) -> HubCache | None:
    """Where Hub ids resolve: --hub-cache, or Hugging Face's default cache; None for 'none'."""
    if args.hub_cache == "none":
        return None
    if args.hub_cache:
        return HubCache(Path(args.hub_cache).expanduser(), args.allow_hub_downloads)
    from huggingface_hub import constants

    return HubCache(Path(constants.HF_HUB_CACHE), args.allow_hub_downloads)


def client_security(args) -> ClientSecurity:
    """The flags, each missing one from KILN_TLS_CA / KILN_TLS_CLIENT_CERT / KILN_TLS_CLIENT_KEY; the token from
    KILN_AUTH_TOKEN (or the file KILN_CLIENT_TOKEN_FILE), never from a flag, where ps would show it."""
    return ClientSecurity.load(getattr(args, "tls_ca", None), getattr(args, "tls_client_cert", None),
                               getattr(args, "tls_client_key", None))


def refuse_setting(exc: Exception) -> int:
    """A bad key, certificate or token file: one line, exit 2 (a usage error, not a crash)."""
    print(f"error: {exc}", file=sys.stderr)
    return 2
