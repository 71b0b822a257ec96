"""The ``kiln`` command: servers, clients and the demo, one subcommand module per concern."""

import argparse
import logging
import os
import sys

from kiln_cli import (
    api_server_commands,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("KILN_LOG_LEVEL", "INFO"))
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.handler(args) or 0
    except security_args.SETTING_ERRORS as exc:  # a key, certificate or token file the command cannot use
        return security_args.refuse_setting(exc)


if __name__ == "__main__":
    sys.exit(main())
