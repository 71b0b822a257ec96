"""A service's Prometheus ``/metrics`` on an HTTP port of its own (``--metrics-port``), from a registry of its own.

Each server process (and each server a test starts in one process) registers its metrics in its own
CollectorRegistry rather than prometheus_client's global one, so two servers never share a counter.

The port needs no token (what scrapers expect), so what a client can make it hold is bounded here:
prometheus_client's own server gives every connection a thread that waits for its request without end, so idle
connections pile up threads in the service's process and the port stops answering. Here a connection silent for
``read_timeout_s`` while its request is read is dropped, and past ``max_connections`` at once a new one is closed
unanswered.
"""

import logging
import socket
import sys
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # scrapes served at once: a Prometheus or two, and people with curl
READ_TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """A line per scrape would only be noise."""


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most ``max_connections`` of them."""

    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # connections the kernel queues for accept (socketserver's 5 drops a burst's SYNs)

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        """A connection dropped for its silence, or reset by its client, is not the server's error: no traceback."""
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("metrics connection from %s dropped: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)


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


def serve_metrics(registry: CollectorRegistry, host: str, port: int, max_connections: int = MAX_CONNECTIONS,
                  read_timeout_s: float = READ_TIMEOUT_S) -> MetricsPort:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; port 0 picks a free one."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (_BoundedServer,), {"address_family": family,
                                                             "max_connections": max_connections})
    handler_class = type("MetricsHandler", (_Handler,), {"timeout": read_timeout_s})
    server = make_server(address[0], port, make_wsgi_app(registry), server_class, handler_class)
    thread = threading.Thread(target=server.serve_forever, name="kiln-metrics", daemon=True)
    thread.start()
    metrics = MetricsPort(server, thread)
    log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics.port)
    return metrics
