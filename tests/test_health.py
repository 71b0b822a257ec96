"""``kiln health`` as compose runs it: a subprocess against a real gRPC server, judged by its exit code."""

import subprocess
import sys

import pytest
from conftest import BackgroundServer

from kiln.rpc.grpc_server import Server
from kiln_cli.service_process import free_port

READY = "kiln.v1.Ready"
DRAINING = "kiln.v1.Draining"


async def _start_server():
    server = Server([READY, DRAINING])
    port = await server.start("127.0.0.1:0")
    await server.set_serving(DRAINING, False)
    return server, port


@pytest.fixture(scope="module")
def server():
    background = BackgroundServer(_start_server)
    yield background
    background.stop()


def kiln_health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln_cli", "health", *args], capture_output=True, text=True,
                          timeout=60)


def test_serving_server_exits_0(server):
    result = kiln_health(server.address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{server.address}: SERVING"


def test_serving_service_exits_0(server):
    result = kiln_health(server.address, "--service", READY)
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout


def test_not_serving_service_exits_1(server):
    result = kiln_health(server.address, "--service", DRAINING)
    assert result.returncode == 1
    assert f"service '{DRAINING}': NOT_SERVING" in result.stderr


def test_unknown_service_exits_1_naming_it(server):
    result = kiln_health(server.address, "--service", "kiln.v1.ExecService/no-such-model")
    assert result.returncode == 1
    assert "'kiln.v1.ExecService/no-such-model': NOT_FOUND" in result.stderr


def test_nothing_listening_exits_1():
    address = f"127.0.0.1:{free_port()}"
    result = kiln_health(address, "--timeout", "2")
    assert result.returncode == 1
    assert f"{address}: UNAVAILABLE" in result.stderr


def test_bad_timeout_is_a_usage_error():
    result = kiln_health("127.0.0.1:1", "--timeout", "0")
    assert result.returncode == 2
    assert "--timeout: must be > 0 seconds" in result.stderr
