"""The README against the code: its test command is .ci/run's, its configuration table names every flag and
environment variable Kiln reads, and its grpcurl bodies parse as the requests they are sent as."""

import argparse
import re
import shlex
from pathlib import Path

import pytest
from google.protobuf import json_format, message_factory
from grpc_health.v1 import health_pb2

from kiln_cli import COMMAND_MODULES
from protos import compile_pb2, exec_pb2

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SOURCE_DIRS = ("kiln", "kiln_cli", "compile_service", "exec_service", "tracing")


def opening_commands() -> list[str]:
    """The commands of the README's first code block, in order."""
    block = re.search(r"```bash\n(.*?)```", README, re.S)[1]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def ci_commands() -> list[str]:
    """What .ci/run executes once it is in the repository root."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith(("#", "set ", "cd "))]


def configuration_table() -> str:
    return README.split("## Configuration", 1)[1].split("\n## ", 1)[0]


def test_readme_opens_with_the_demo_then_the_ci_command():
    assert README.index("```bash") < README.index("\n## "), "the two commands come before any section"
    demo, tests = opening_commands()
    assert "pip install torch==2.13.0 -e ." in demo and demo.endswith("&& kiln demo")
    assert tests == " && ".join(ci_commands())


def _commands(subparsers) -> list[argparse.ArgumentParser]:
    """Every (sub)command parser, nested ones (``kiln bench latency``) included."""
    out = []
    for command in subparsers.choices.values():
        out.append(command)
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += _commands(action)
    return out


def test_every_cli_flag_is_in_the_configuration_table():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    for module in COMMAND_MODULES:
        module.register(subparsers)
    table = configuration_table()
    flags = {flag for command in _commands(subparsers) for action in command._actions
             for flag in action.option_strings if flag.startswith("--") and flag != "--help"}
    assert len(flags) > 30
    missing = sorted(flag for flag in flags if f"`{flag}`" not in table)
    assert not missing, f"flags missing from the README's configuration table: {missing}"


def test_every_environment_variable_kiln_reads_is_in_the_configuration_table():
    read = set()
    for directory in SOURCE_DIRS:
        for path in (ROOT / directory).rglob("*.py"):
            read |= set(re.findall(r"environ\.get\(\s*\"([A-Z0-9_]+)\"", path.read_text()))
    assert {"KILN_STORE", "KILN_LOG_LEVEL", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= read
    table = configuration_table()
    missing = sorted(name for name in read if f"`{name}`" not in table)
    assert not missing, f"environment variables missing from the README's configuration table: {missing}"


def grpcurl_calls() -> list[tuple[str, str]]:
    """(JSON body, full method name) of every grpcurl example that sends a body."""
    text = README.replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        if line.startswith("grpcurl") and " -d " in line:
            args = shlex.split(line)
            calls.append((args[args.index("-d") + 1], args[-1]))
    return calls


REQUEST_FILES = (compile_pb2, exec_pb2, health_pb2)


def request_class(method: str):
    service, name = method.rsplit("/", 1)
    for module in REQUEST_FILES:
        for descriptor in module.DESCRIPTOR.services_by_name.values():
            if descriptor.full_name == service:
                return message_factory.GetMessageClass(descriptor.methods_by_name[name].input_type)
    raise AssertionError(f"no service {service}")


@pytest.mark.parametrize(("body", "method"), grpcurl_calls())
def test_grpcurl_bodies_are_valid_requests(body, method):
    json_format.Parse(body, request_class(method)())


def test_grpcurl_examples_cover_the_main_calls():
    methods = {method for _, method in grpcurl_calls()}
    assert {"kiln.v1.CompileService/Compile", "kiln.v1.ExecService/LoadModel",
            "kiln.v1.ExecService/Generate"} <= methods
    assert "grpcurl -plaintext localhost:50051 list" in README
    assert re.search(r"grpcurl -plaintext \S+ describe kiln\.v1\.", README)
