"""How CLI commands print: human lines and a progress bar on a terminal, one JSON object per line with --json."""

import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict


class Printer:
    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.tty = sys.stdout.isatty() and not as_json
        self._bar_open = False

    def message(self, msg, text: str) -> None:
        """Print a protobuf message as JSON, or ``text`` for a person."""
        if self.as_json:
            print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True)), flush=True)
        else:
            self.line(text)

    def line(self, text: str) -> None:
        if self.as_json:
            return
        self._close_bar()
        print(text, flush=True)

    def progress(self, done: int, total: int, label: str) -> None:
        """A bar redrawn in place on a terminal; nothing elsewhere (the lines say enough)."""
        if not self.tty or total <= 0:
            return
        width = 30
        filled = width * done // total
        sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<30}")
        sys.stdout.flush()
        self._bar_open = True

    def _close_bar(self) -> None:
        if self._bar_open:
            sys.stdout.write("\n")
            self._bar_open = False


def report_rpc_error(exc: grpc.RpcError) -> int:
    """A failed call as the status and message a person can act on; exit code 1."""
    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1
