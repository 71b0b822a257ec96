"""A service that crashes in native code leaves every thread's Python stack in its log, and one that hangs prints
the same on SIGUSR1: a real `kiln compile-server` started as the benches and `kiln demo` start it."""

import os
import signal
import time

from kiln.store.signing import PRIVATE_KEY_FILE, generate_key_pair
from kiln_cli.service_process import ServiceProcess, child_environment, free_port, kiln_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_for(log, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace")
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never reached the log:\n{log.read_text(errors='replace')[-3000:]}")


def test_a_crash_leaves_a_python_stack_in_the_log(tmp_path):
    generate_key_pair(tmp_path / "keys")
    port = free_port()
    env = child_environment() | {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    service = ServiceProcess("compile", kiln_command(
        "compile-server", "--host", "127.0.0.1", "--port", str(port), "--store", str(tmp_path / "store"),
        "--signing-key", str(tmp_path / "keys" / PRIVATE_KEY_FILE)), f"127.0.0.1:{port}", tmp_path / "compile.log",
        env)
    service.start()
    try:
        service.wait_healthy(timeout=120)
        os.kill(service.process.pid, signal.SIGUSR1)
        dumped = wait_for(service.log_path, "serve_until_signal")
        assert "Thread 0x" in dumped and service.process.poll() is None, "SIGUSR1 prints the stacks and goes on"
        os.kill(service.process.pid, signal.SIGSEGV)
        assert service.process.wait(30) == -signal.SIGSEGV
        crashed = wait_for(service.log_path, "Fatal Python error: Segmentation fault")
        assert crashed.count("Thread 0x") > dumped.count("Thread 0x"), "every thread's stack at the crash"
    finally:
        service.kill()
