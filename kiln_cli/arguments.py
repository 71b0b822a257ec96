"""How every command reads its arguments: value types that refuse a malformed value the argparse way (one line
naming the option, exit 2, no traceback), the server address every client command takes the same way, and help
that shows each option's default."""

import argparse
import json

# Where client commands find a server when none is named: the ports the servers listen on by default.
COMPILE_ADDRESS = "localhost:50051"
EXEC_ADDRESS = "localhost:50052"
CLIENT_ENVIRONMENT = """environment:
  KILN_AUTH_TOKEN         bearer token sent with every call (or KILN_CLIENT_TOKEN_FILE: a file holding it)
  KILN_TLS_CA             CA of the server's certificate: use TLS (as --tls-ca)
  KILN_TLS_CLIENT_CERT    client certificate for mutual TLS (as --tls-client-cert), KILN_TLS_CLIENT_KEY its key
  KILN_LOG_LEVEL          log level (as kiln --log-level)"""

SERVER_ENVIRONMENT = """environment (each the default of its flag):
  KILN_TLS_CERT, KILN_TLS_KEY, KILN_TLS_CLIENT_CA    --tls-cert, --tls-key, --tls-client-ca
  KILN_AUTH_TOKEN_FILE    --auth-token-file
  KILN_MAX_REQUEST_BYTES  --max-request-bytes
  KILN_MODEL_ROOTS        --model-root, several separated by ':'
  KILN_SIGNING_KEY, KILN_TRUSTED_KEYS, KILN_STORE, KILN_EXEC_CACHE    --signing-key, --trusted-keys, --store, --cache
  OTEL_EXPORTER_OTLP_ENDPOINT    where spans go (Jaeger's OTLP port); unset: no tracing"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless it says its default itself or has none worth saying (a
    flag, an unset value whose meaning the help gives)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "%(default)" in help_text or "default:" in help_text or not action.option_strings:
            return help_text
        default = action.default
        if default is None or default is False or default == "" or default == argparse.SUPPRESS or \
                isinstance(default, list):
            return help_text
        return f"{help_text} (default: %(default)s)"


def int_list(text: str) -> list[int]:
    """``1,2,3`` (spaces allowed, empty for none); a value that is not an integer is an argument error."""
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            values.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer (expected comma-separated integers, e.g. "
                                             f"1,2,3)") from None
    return values


def name_list(text: str) -> list[str]:
    """``a,b`` as names; empty for none."""
    return [item.strip() for item in text.split(",") if item.strip()]


def json_object(text: str) -> str:
    """A JSON object, kept as its text (the server checks its keys); empty for none."""
    if not text.strip():
        return ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return text


def add_server_address(p: argparse.ArgumentParser, default: str | None, what: str, positional: bool = True) -> None:
    """``--server HOST:PORT`` on every client command; where a command took the address as its first argument it
    still does (``kiln models localhost:50052``). ``default`` None: one of the two must be given."""
    if positional:
        p.add_argument("address", nargs="?", default=None, metavar="ADDRESS",
                       help=f"{what} address, the same as --server")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help=f"{what} address" + (f" (default: {default})" if default else ""))
    p.set_defaults(default_address=default, address_parser=p)


def resolve_server_address(args: argparse.Namespace) -> None:
    """Sets ``args.server`` to the one address the command was given (or its default); two different ones, or none
    where there is no default, are an argument error."""
    positional, flag = getattr(args, "address", None), args.server
    if positional and flag and positional != flag:
        args.address_parser.error(f"the address is given twice ({positional} and --server {flag}): give one")
    args.server = positional or flag or args.default_address
    if not args.server:
        args.address_parser.error("an address is needed: ADDRESS or --server HOST:PORT")
