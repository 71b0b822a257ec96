"""The ``--metrics-port`` server's bounds (tracing.metrics_port), over raw sockets: idle connections neither pile up
threads in the service's process nor keep the port from answering a scrape once they are dropped."""

import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from tracing.metrics_port import serve_metrics


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def closed_within(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_past_the_cap_are_closed_and_the_held_ones_time_out():
    registry = CollectorRegistry()
    Counter("kiln_probe", "a counter to read back", registry=registry).inc(3)
    metrics = serve_metrics(registry, "127.0.0.1", 0, max_connections=4, read_timeout_s=1.0)
    try:
        threads = threading.active_count()
        held = [socket.create_connection(("127.0.0.1", metrics.port)) for _ in range(4)]
        for conn in held:
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request line, then nothing
        time.sleep(0.3)
        extra = [socket.create_connection(("127.0.0.1", metrics.port)) for _ in range(50)]
        assert all(closed_within(conn, 5) for conn in extra)  # past the cap: closed unanswered
        assert threading.active_count() <= threads + 4
        assert all(closed_within(conn, 5) for conn in held)  # silent past the read timeout: dropped
        assert scrape(metrics.port)["kiln_probe_total"] == 3
    finally:
        metrics.close()
