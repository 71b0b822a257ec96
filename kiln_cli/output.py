"""How CLI commands print: human lines and a progress bar on a terminal, one JSON object per line with --json."""

import json
import sys

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict

from kiln.client.failures import EXEC_SERVICE, explain
from kiln.rpc.client_security import PLAINTEXT, ClientSecurity

_INT64_TYPES = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


class Printer:
    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.tty = sys.stdout.isatty() and not as_json
        self._bar_open = False

    def message(self, msg, text: str) -> None:
        """Print a protobuf message as JSON, or ``text`` for a person."""
        if self.as_json:
            print(json.dumps(message_dict(msg)), flush=True)
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


def message_dict(msg) -> dict:
    """A message as JSON-ready values, with 64-bit integers as numbers: protobuf's JSON mapping writes them as
    strings, which every consumer of ``--json`` would then have to parse back."""
    return _int64_as_numbers(msg.DESCRIPTOR, MessageToDict(msg, preserving_proto_field_name=True))


def _int64_as_numbers(descriptor: Descriptor, values: dict) -> dict:
    for field in descriptor.fields:
        if field.name not in values:
            continue
        value = values[field.name]
        if field.type in _INT64_TYPES:
            values[field.name] = [int(v) for v in value] if field.is_repeated else int(value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if field.is_repeated else [value]:
                if isinstance(item, dict):
                    _int64_as_numbers(field.message_type, item)
    return values


def report_rpc_error(exc: grpc.RpcError, address: str = "", security: ClientSecurity = PLAINTEXT,
                     service: str = EXEC_SERVICE, method: str = "") -> int:
    """A failed call as the status and message a person can act on (what answers at ``address`` when it is the
    wrong service, a TLS handshake that failed); exit code 1."""
    if address:
        print(f"error: {explain(exc, address, security, service, method)}", file=sys.stderr)
    else:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1
