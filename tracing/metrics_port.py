"""A service's Prometheus ``/metrics`` on an HTTP port of its own (``--metrics-port``), from a registry of its own.

Each server process (and each server a test starts in one process) registers its metrics in its own
CollectorRegistry rather than prometheus_client's global one, so two servers never share a counter.
"""

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


@dataclass
class MetricsPort:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsPort:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; port 0 picks a free one."""
    server, thread = start_http_server(port, host, registry=registry)
    metrics = MetricsPort(server, thread)
    log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics.port)
    return metrics
