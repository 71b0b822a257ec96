"""The ``kiln`` command: servers, clients and the demo, one subcommand module per concern."""

import argparse
import logging
import os
import sys

from kiln import __version__
from kiln_cli import (
    api_server_commands,
    arguments,
    bench_commands,
    compile_commands,
    demo_commands,
    exec_commands,
    health_commands,
    keygen_commands,
    security_args,
)

# Each module contributes its subcommands with register(subparsers); handlers return an exit code.
COMMAND_MODULES = [compile_commands, exec_commands, api_server_commands, health_commands, demo_commands, bench_commands,
                   keygen_commands]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__, formatter_class=arguments.HelpFormatter,
                                     epilog=arguments.CLIENT_ENVIRONMENT)
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("KILN_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR, of the log on stderr (env KILN_LOG_LEVEL)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    for sub in _parsers(parser):
        sub.formatter_class = arguments.HelpFormatter
    return parser


def _parsers(parser: argparse.ArgumentParser):
    """Every subcommand's parser, nested ones (``kiln bench latency``) too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _parsers(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "default_address"):
        arguments.resolve_server_address(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.handler(args) or 0
    except security_args.SETTING_ERRORS as exc:  # a key, certificate or token file the command cannot use
        return security_args.refuse_setting(exc)
    except KeyboardInterrupt:  # Ctrl-C where a command has no handling of its own: no traceback
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
