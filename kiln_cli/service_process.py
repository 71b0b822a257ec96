"""A Kiln server run as a child process on loopback: started, waited on until healthy, stopped with SIGTERM.

``kiln demo`` runs the compile and execute services this way, and the compose tests run each compose service's
command the same way, so both prove the path a user takes without Docker.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from kiln_cli.health_commands import SERVING, check

# How often to ask the health service while a server starts (importing torch alone takes seconds).
POLL_S = 0.5


class ServiceFailed(RuntimeError):
    """A child server that exited, never became healthy, or did not stop cleanly; the message says which."""


def free_port() -> int:
    """A loopback port nobody listens on now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln_command(*args: str) -> list[str]:
    """``kiln ARGS`` through this interpreter, so it works without the console script on PATH."""
    return [sys.executable, "-m", "kiln_cli", *args]


class ServiceProcess:
    """One server: its command, its address, its log file."""

    def __init__(self, name: str, argv: Sequence[str], address: str, log_path: Path, env: dict | None = None):
        self.name = name
        self.argv = list(argv)
        self.address = address
        self.log_path = Path(log_path)
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until the health service said SERVING; ServiceFailed if the child died or time ran out."""
        started = time.monotonic()
        last = "no answer yet"
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise ServiceFailed(f"{self.name} service exited with code {self.process.returncode} before it "
                                    f"served\n{self.log_tail()}")
            try:
                last = check(self.address, timeout=POLL_S * 2)
                if last == SERVING:
                    return time.monotonic() - started
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(POLL_S)
        raise ServiceFailed(f"{self.name} service at {self.address} not SERVING after {timeout:.0f}s "
                            f"(last: {last})\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the graceful shutdown; SIGKILL and ServiceFailed if it hangs or exits non-zero."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise ServiceFailed(f"{self.name} service ignored SIGTERM for {timeout:.0f}s and was killed\n"
                                f"{self.log_tail()}") from None
        if code != 0:
            raise ServiceFailed(f"{self.name} service exited with code {code} on SIGTERM\n{self.log_tail()}")
        return code

    def kill(self) -> None:
        """For cleanup after a failure: no grace, no questions."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(f"  {self.name}| {line}" for line in text)


_SECURITY_ENV = ("KILN_TLS_", "KILN_AUTH_", "KILN_CLIENT_TOKEN_FILE", "KILN_SIGNING_KEY", "KILN_TRUSTED_KEYS",
                 "KILN_MODEL_ROOTS")


def child_environment() -> dict:
    """This process's environment, OTEL_* included, so the children trace where we would.

    OTEL_SERVICE_NAME is left out: each server names itself (kiln-compile, kiln-exec), and one shared name would
    merge the two services in Jaeger. So are the security settings (KILN_TLS_*, tokens, keys, roots): meant for
    some other deployment, they would turn the local plaintext pair against itself. PYTHONFAULTHANDLER is set, so
    that a crash leaves its stack in the log.
    """
    env = {k: v for k, v in os.environ.items() if k != "OTEL_SERVICE_NAME" and not k.startswith(_SECURITY_ENV)}
    env["PYTHONUNBUFFERED"] = "1"
    # A native crash anywhere in the child, or in a process it starts (Inductor's compile workers inherit this),
    # leaves the Python stack of every thread in its log, from the first import on.
    env["PYTHONFAULTHANDLER"] = "1"
    return env


class LocalServices:
    """The compile and execute services as child processes on loopback: what ``kiln demo`` and ``kiln bench``
    run when no server address is given. ``start()`` returns once both are healthy; ``stop()`` sends each SIGTERM.

    Bundles are signed as anywhere else: with a key pair kept beside the store (``<store>.keys``, made on first
    use), so a kept store stays loadable from one run to the next. With ``openai_port`` the execute service serves
    its own OpenAI endpoint there too (--openai-port).
    """

    def __init__(self, workdir: Path, store: Path, env: dict | None = None, openai_port: int | None = None):
        from kiln.store.signing import generate_key_pair, local_keys_dir  # cryptography: only where servers are started

        compile_port, exec_port = free_port(), free_port()
        env = env if env is not None else child_environment()
        signing_key, public_key = generate_key_pair(local_keys_dir(store))
        self.compile = ServiceProcess(
            "compile", kiln_command("compile-server", "--host", "127.0.0.1", "--port", str(compile_port),
                                    "--store", str(store), "--signing-key", str(signing_key)),
            f"127.0.0.1:{compile_port}", workdir / "compile.log", env)
        self.exec = ServiceProcess(
            "exec", kiln_command("exec-server", "--host", "127.0.0.1", "--port", str(exec_port),
                                 "--compile-server", self.compile.address, "--cache", str(workdir / "exec-cache"),
                                 "--trusted-keys", str(public_key),
                                 *(("--openai-port", str(openai_port)) if openai_port is not None else ())),
            f"127.0.0.1:{exec_port}", workdir / "exec.log", env)
        self.started: list[ServiceProcess] = []

    def start(self, timeout: float, on_healthy=lambda service, seconds: None) -> None:
        for service in (self.compile, self.exec):
            service.start()
            self.started.append(service)
        for service in self.started:
            on_healthy(service, service.wait_healthy(timeout))

    def stop(self, on_stopped=lambda service: None) -> None:
        """SIGTERM each, exec first; ServiceFailed if one does not exit cleanly."""
        for service in reversed(self.started):
            service.stop()
            on_stopped(service)

    def log_tails(self, lines: int = 250) -> str:
        """The end of each started service's log: its own account of a failure (a faulthandler stack of every
        thread is ~200 lines), for a caller to print before the workdir holding the logs goes."""
        return "\n".join(f"--- the end of {service.log_path.name}:\n{service.log_tail(lines)}"
                         for service in self.started)

    def cleanup(self) -> None:
        """After a failure: stop what still runs, gracefully where it lets us."""
        for service in reversed(self.started):
            try:
                service.stop()
            except ServiceFailed:
                service.kill()

    def kill(self) -> None:
        """No grace: what a second Ctrl-C asks for."""
        for service in reversed(self.started):
            service.kill()
