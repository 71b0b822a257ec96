"""The ``kiln`` command as a new user meets it: ``python -m kiln_cli`` in a subprocess, its exit code and its words.

Argument errors are argparse's (a line naming the option, exit 2, never a traceback); a call to the wrong service,
or to a TLS server without a CA, says so; every client command takes ``--server``; help shows each default and the
environment variables; empty listings say they are empty."""

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BackgroundServer

from kiln import __version__
from kiln_cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CLIENT_COMMANDS = ("compile", "artifacts", "load", "generate", "models", "unload", "stats", "health")


def kiln(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln_cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def assert_usage_error(proc: subprocess.CompletedProcess, words: str) -> None:
    """Exit 2 with argparse's usage and one error line, and no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and words in errors[0], proc.stderr


@pytest.mark.parametrize(("args", "words"), [
    (("generate", "--model", "m", "--prompt-ids", "1,a"), "argument --prompt-ids: 'a' is not an integer"),
    (("generate", "--model", "m", "--prompt-ids", "1", "--stop-token-ids", "x"),
     "argument --stop-token-ids: 'x' is not an integer"),
    (("compile", "tiny-llama", "--compile-sizes", "1,x"), "argument --compile-sizes: 'x' is not an integer"),
    (("load", "tiny-llama", "--capture-sizes", "4,,y"), "argument --capture-sizes: 'y' is not an integer"),
    (("load", "tiny-llama", "--inductor-config", "[1]"), "argument --inductor-config: expected a JSON object"),
    (("models", "localhost:1", "--server", "localhost:2"), "the address is given twice"),
    (("health",), "an address is needed"),
    (("exec-server", "--max-connection-age-s", "0.5"),
     "argument --max-connection-age-s: must be 0 (never) or in [1, 86400] seconds, got 0.5"),
])
def test_a_malformed_argument_is_one_line_and_exit_2(args, words):
    assert_usage_error(kiln(*args), words)


def test_version():
    proc = kiln("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kiln {__version__}"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in _commands(sub).items()})
    return found


def test_every_option_has_help_and_every_client_command_takes_server():
    commands = _commands(build_parser())
    undocumented = [f"{name} {action.option_strings[0]}" for name, sub in commands.items() for action in sub._actions
                    if action.option_strings and action.option_strings[0] != "-h" and not action.help]
    assert not undocumented, undocumented
    for name in CLIENT_COMMANDS:
        assert "--server" in commands[name]._option_string_actions, name
    assert "--server" in commands["bench latency"]._option_string_actions


def test_help_shows_defaults_and_the_environment():
    out = kiln("generate", "--help").stdout
    assert "sampling temperature; 0 is greedy (default: 1.0)" in " ".join(out.split())
    assert "KILN_AUTH_TOKEN" in out and "(default: localhost:50052)" in out
    out = " ".join(kiln("load", "--help").stdout.split())
    for words in ("--max-num-seqs MAX_NUM_SEQS most sequences in one step (default: 64)",
                  "--max-compiled-tokens MAX_COMPILED_TOKENS upper end of the compiled token range, a cache-key "
                  "factor (default: 512)", "--weights-seed WEIGHTS_SEED seed of the dummy weights (default: 0)"):
        assert words in out
    assert "KILN_SIGNING_KEY" in kiln("compile-server", "--help").stdout


def test_the_address_as_argument_or_as_server(exec_server, tiny_loaded):
    for args in (("models", exec_server.address), ("models", "--server", exec_server.address),
                 ("stats", "--server", exec_server.address, "--model", "tiny")):
        proc = kiln(*args)
        assert proc.returncode == 0 and "tiny" in proc.stdout, proc.stderr


def test_the_wrong_service_is_named(compile_server, exec_server):
    proc = kiln("models", "--server", compile_server.address)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "UNIMPLEMENTED: this is a Kiln compile service; ListModels is on the execute service" in proc.stderr
    proc = kiln("compile", "tiny-llama", "--server", exec_server.address)
    assert proc.returncode == 1
    assert "this is a Kiln execute service; Compile is on the compile service" in proc.stderr
    proc = kiln("load", compile_server.address, "tiny-llama")
    assert "this is a Kiln compile service; LoadModel is on the execute service" in proc.stderr


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """A bare Kiln server with TLS (a certificate of kiln keygen's CA) and no Kiln service behind it."""
    from kiln.rpc import keygen
    from kiln.rpc.grpc_server import Server, ServerSecurity
    from kiln.rpc.tls import ServerTls

    tls = keygen.tls_material(tmp_path_factory.mktemp("cli-tls"), ["localhost", "127.0.0.1"])

    async def start():
        server = Server(["kiln.v1.ExecService"], (), ServerSecurity(ServerTls.load(tls.server_cert, tls.server_key)))
        return server, await server.start("127.0.0.1:0")

    server = BackgroundServer(start)
    yield server
    server.stop()


def test_a_tls_server_without_a_ca_is_a_tls_handshake_failure(tls_server):
    for args in (("models", "--server", tls_server.address), ("health", tls_server.address)):
        proc = kiln(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "TLS handshake failure" in proc.stderr and "--tls-ca" in proc.stderr, proc.stderr
    proc = kiln("models", "--server", "127.0.0.1:1")
    assert proc.returncode == 1 and "nothing answers at 127.0.0.1:1" in proc.stderr


@pytest.fixture(scope="module")
def empty_servers(tmp_path_factory, signer, trusted_keys):
    """A compile service with an empty store and an execute service with no model."""
    from compile_service.server import CompileServerSettings, start_compile_server
    from exec_service.server import ExecServerSettings, start_exec_server

    compile_settings = CompileServerSettings("127.0.0.1:0", tmp_path_factory.mktemp("empty-store"), signer)
    compile_server = BackgroundServer(lambda: start_compile_server(compile_settings))
    exec_settings = ExecServerSettings("127.0.0.1:0", trusted_keys, cache_dir=tmp_path_factory.mktemp("empty-cache"))
    exec_server = BackgroundServer(lambda: start_exec_server(exec_settings))
    yield compile_server, exec_server
    exec_server.stop()
    compile_server.stop()


def test_empty_listings_say_so(empty_servers):
    compile_server, exec_server = empty_servers
    for args, words in ((("artifacts", "list", "--server", compile_server.address), "no artifacts"),
                        (("models", exec_server.address), "no models loaded"),
                        (("stats", exec_server.address), "no forward statistics yet")):
        proc = kiln(*args)
        assert proc.returncode == 0 and words in proc.stdout, (args, proc.stdout, proc.stderr)
        assert kiln(*args, "--json").stdout == ""  # JSON lines: nothing to list is no line


class SlowToStop:
    """LocalServices whose graceful stop is interrupted by a second Ctrl-C, as a user's would be."""

    def __init__(self):
        self.killed = False

    def cleanup(self) -> None:
        signal.raise_signal(signal.SIGINT)

    def kill(self) -> None:
        self.killed = True


def test_a_second_ctrl_c_while_the_demo_stops_kills_the_services_without_a_traceback(capsys):
    from kiln_cli.demo_commands import stop_services

    services = SlowToStop()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop_services(services)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert services.killed and "interrupted again: killing the services" in capsys.readouterr().err
