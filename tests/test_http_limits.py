"""The HTTP port's bounds on what one client can make it hold (exec_service.openai.http_limits), through a real
``kiln api-server`` on loopback and raw sockets: a head too large or too slow, a body too slow, connections and
bodies in flight past their caps. Nothing listens behind the gateway: every refusal here comes before a request
reaches an execute service."""

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry

from exec_service.openai.gateway_metrics import GatewayMetrics
from exec_service.openai.http_limits import HttpLimits
from exec_service.openai.server import ApiServer, ApiServerSettings
from kiln.rpc import keygen
from kiln_cli.service_process import free_port, kiln_command


@contextmanager
def gateway(limits: HttpLimits, max_request_bytes: int = 4 * 1024 * 1024, metrics: GatewayMetrics | None = None):
    server = ApiServer(ApiServerSettings("127.0.0.1", 0, f"127.0.0.1:{free_port()}",
                                         max_request_bytes=max_request_bytes, limits=limits), metrics)
    port = server.start()
    try:
        yield port
    finally:
        server.stop()


def answer(conn: socket.socket, timeout_s: float = 10.0) -> tuple[int, dict, bool]:
    """(status, error object, whether the server then closed the connection), read off the raw socket."""
    conn.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise AssertionError(f"closed without an answer after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    try:
        closed = conn.recv(1) == b""
    except ConnectionResetError:
        closed = True
    return int(head.split()[1]), json.loads(body[:length])["error"], closed


def still_answers(port: int) -> None:
    with pytest.raises(urllib.error.HTTPError) as health:  # 503: no execute service behind; but an HTTP answer
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)
    assert health.value.code == 503


def rss_mb() -> float:
    return int(open(f"/proc/{os.getpid()}/status").read().split("VmRSS:")[1].split()[0]) / 1024


def test_an_endless_header_is_431_before_the_server_holds_more_than_its_bound():
    with gateway(HttpLimits()) as port:
        before = rss_mb()
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Filler: ")
        sent = 0
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(256):  # 256 MiB if nothing stopped it; the server in this process would hold it all
                conn.sendall(b"a" * (1 << 20))
                sent += 1
        assert sent < 16, f"{sent} MiB of one header sent before the server closed the connection"
        assert rss_mb() - before < 64
        still_answers(port)


def test_a_head_over_the_bound_is_answered_431_in_openais_shape():
    registry = CollectorRegistry()
    with gateway(HttpLimits(max_head_bytes=4096), metrics=GatewayMetrics(registry)) as port:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        for _ in range(4):  # in pieces: the bound counts what the head has sent so far, not one read
            conn.sendall(b"X-Filler: " + b"a" * 2000 + b"\r\n")
            time.sleep(0.05)
        status, error, closed = answer(conn)
        assert (status, error["code"], closed) == (431, "request_header_too_large", True)
        assert "4096 bytes" in error["message"]
        # A head under the bound, whose body's first bytes come in the same read, is served.
        body = json.dumps({"model": "m", "prompt": "p", "pad": "a" * 20000}).encode()
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status, error, _ = answer(conn, 30)
        assert status == 503 and error["code"] == "service_unavailable"  # it reached the app: nothing behind it
    # The refusal before any path was read is counted, under the catch-all endpoint.
    assert registry.get_sample_value("kiln:api_requests_total", {"endpoint": "other", "status": "431"}) == 1
    assert registry.get_sample_value("kiln:api_requests_total",
                                     {"endpoint": "/v1/completions", "status": "503"}) == 1


def test_a_head_that_never_ends_and_a_silent_connection_are_closed_after_the_head_timeout():
    with gateway(HttpLimits(head_timeout_s=0.5)) as port:
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        silent = socket.create_connection(("127.0.0.1", port))
        started = time.monotonic()
        status, error, closed = answer(slow)
        assert (status, error["code"], closed) == (408, "request_timeout", True)
        assert time.monotonic() - started < 5
        status, _, closed = answer(silent)
        assert (status, closed) == (408, True)
        still_answers(port)


def test_a_body_that_never_ends_is_408():
    with gateway(HttpLimits(body_timeout_s=0.5)) as port:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        status, error, closed = answer(conn)
        assert (status, error["code"], closed) == (408, "request_timeout", True)


def test_connections_past_the_cap_are_503_and_closed():
    with gateway(HttpLimits(max_connections=2)) as port:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.2)  # both accepted
        extra = socket.create_connection(("127.0.0.1", port))
        status, error, closed = answer(extra)
        assert (status, error["code"], closed) == (503, "server_busy", True)
        assert "--max-http-connections" in error["message"]
        for conn in held:
            conn.close()
        time.sleep(0.2)
        still_answers(port)


def test_bodies_in_flight_past_the_budget_are_503_and_the_budget_is_given_back():
    # Two bodies of at most 1,000 bytes may be held at once.
    with gateway(HttpLimits(buffered_bodies=2), max_request_bytes=1000) as port:
        def start_body(sent: int) -> socket.socket:
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b" " * sent)
            return conn

        held = [start_body(900), start_body(900)]
        time.sleep(0.3)  # both bodies' first 900 bytes read
        status, error, closed = answer(start_body(900))
        assert (status, error["code"], closed) == (503, "server_busy", True)
        for conn in held:
            conn.close()
        time.sleep(0.3)
        body = json.dumps({"model": "m", "prompt": "p"}).encode()
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status, error, _ = answer(conn, 30)
        assert status == 503 and error["code"] == "service_unavailable"  # past the budget check: the app's answer


def test_kiln_api_server_takes_its_connection_cap_from_the_flag(tmp_path):
    port = free_port()
    log = (tmp_path / "api-server.log").open("w")
    child = subprocess.Popen(kiln_command("api-server", "--port", str(port), "--exec-server",
                                          f"127.0.0.1:{free_port()}", "--max-http-connections", "1"),
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it answers (/health is 503 with nothing behind it)
            try:
                probe = socket.create_connection(("127.0.0.1", port))
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert answer(probe)[0] == 503
                probe.close()
                break
            except (ConnectionError, AssertionError):
                assert child.poll() is None and time.monotonic() < deadline, (tmp_path / "api-server.log").read_text()
                time.sleep(0.2)
        time.sleep(0.2)  # the probe's connection gone
        held = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.2)
        status, error, closed = answer(socket.create_connection(("127.0.0.1", port)))
        assert (status, error["code"], closed) == (503, "server_busy", True)
        assert "at most 1 connections at once (--max-http-connections)" in error["message"]
        held.close()
    finally:
        child.terminate()
        child.wait(timeout=60)
        log.close()
    refused = subprocess.run(kiln_command("api-server", "--exec-server", "127.0.0.1:1", "--max-http-connections", "0"),
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--max-http-connections: must be a count" in refused.stderr


def test_https_serves_with_the_bounds_and_refuses_plaintext(tmp_path):
    """--https-cert / --https-key: the OpenAI client's own stack (urllib here) reaches /health over TLS with the CA,
    the head bound holds inside TLS, and a plaintext request to the port gets no HTTP answer."""
    tls = keygen.tls_material(tmp_path, ["localhost", "127.0.0.1"])
    server = ApiServer(ApiServerSettings("127.0.0.1", 0, f"127.0.0.1:{free_port()}", https_cert=str(tls.server_cert),
                                         https_key=str(tls.server_key), limits=HttpLimits(max_head_bytes=4096)))
    port = server.start()
    try:
        context = ssl.create_default_context(cafile=str(tls.ca))
        with pytest.raises(urllib.error.HTTPError) as health:  # 503: nothing behind; answered over TLS
            urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=30, context=context)
        assert health.value.code == 503
        health.value.close()  # a kept-alive TLS connection left open would hold the server's stop for its grace
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1") as conn:
            conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 8192 + b"\r\n")
            status, error, _ = answer(conn)
        assert (status, error["code"]) == (431, "request_header_too_large")
        plain = socket.create_connection(("127.0.0.1", port))
        plain.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        plain.settimeout(10)
        try:
            reply = plain.recv(65536)
        except ConnectionResetError:
            reply = b""
        assert not reply.startswith(b"HTTP/1.1 "), reply
    finally:
        server.stop()
