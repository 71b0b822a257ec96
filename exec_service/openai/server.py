"""``kiln api-server``'s process: the gateway's app on uvicorn, HTTPS where given a certificate. The same server
carries an execute service's own OpenAI endpoint (``kiln exec-server --openai-port``), over a LocalExecClient.

``run()`` blocks until SIGINT/SIGTERM, then lets requests in flight finish for the shutdown grace and returns (an
exit status of 0, as the other servers'); ``start()`` serves from a thread of this process, for tests and embedding.
"""

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from exec_service.openai.app import build_app
from exec_service.openai.exec_client import ExecClient
from exec_service.openai.gateway_metrics import GatewayMetrics
from exec_service.openai.http_limits import DEFAULT_LIMITS, HttpLimits
from exec_service.openai.http_protocol import BoundedHttpToolsProtocol
from kiln.rpc.grpc_server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_GRACE_S, is_loopback
from kiln.rpc.tls import ClientTls

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ApiServerSettings:
    host: str
    port: int  # 0 picks a free one
    target: str  # the execute services: host:port, ipv4:a:p,b:p or dns:///name:port
    tls: ClientTls | None = None  # towards the execute services
    server_name: str | None = None  # the name their certificate carries, where the target does not say it
    https_cert: str | None = None  # this gateway's own certificate and key: HTTPS
    https_key: str | None = None
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies are 413, unread
    limits: HttpLimits = DEFAULT_LIMITS  # what one client can make the server hold, and for how long
    cors_origins: tuple[str, ...] = ()  # web origins whose pages may call the API from a browser ("*": any)


class ApiServer:
    def __init__(self, settings: ApiServerSettings, metrics: GatewayMetrics | None = None,
                 client_factory: Callable[[], ExecClient] | None = None):
        """``client_factory``: what the app calls; by default an ExecClient of ``settings.target``."""
        self.settings = settings
        app = build_app(client_factory or (lambda: ExecClient(settings.target, settings.tls, settings.server_name)),
                        metrics, settings.max_request_bytes, settings.limits, settings.cors_origins)
        # asyncio's loop, not uvloop (which the CLI's gRPC servers run on): uvloop made no difference here beyond the
        # runs' spread, to a lone request's first token (bench/gateway_overhead.py) or at rate inf through either
        # HTTP path (bench/serving.py, thirteenth session). The HTTP parser is httptools, a dependency, rather than
        # h11: ~0.2 ms of a request's first token and 0.4 ms of CPU less; its protocol with Kiln's bounds.
        # Refused before a path is read: counted under the catch-all endpoint label.
        refused = functools.partial(metrics.request_done, "other") if metrics is not None else None
        protocol = functools.partial(BoundedHttpToolsProtocol, limits=settings.limits, refused=refused)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", loop="asyncio",
                                http=protocol,
                                ssl_certfile=settings.https_cert, ssl_keyfile=settings.https_key,
                                timeout_graceful_shutdown=int(settings.shutdown_grace_s), access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM. uvicorn serves from a thread, so these signals are this thread's to
        handle (uvicorn's own handling would end the process by re-raising them)."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stop.set())
        port = self.start()
        log.info("OpenAI-compatible API on %s://%s:%d/v1", "https" if self.settings.https_cert else "http",
                 self.settings.host, port)
        stop.wait()
        log.info("shutting down: letting requests in flight finish for up to %.0f s", self.settings.shutdown_grace_s)
        self.stop()

    def start(self) -> int:
        """Serve from a daemon thread; returns the port once it listens."""
        self._warn_if_open()
        self._thread = threading.Thread(target=self._server.run, name="kiln-api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start on {self.settings.host}:{self.settings.port}")
            time.sleep(0.02)
        return self.port

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.settings.shutdown_grace_s + 5)

    def _warn_if_open(self) -> None:
        if not is_loopback(f"{self.settings.host}:{self.settings.port}") and not self.settings.https_cert:
            log.warning("SECURITY: the API server listens on %s without HTTPS (--https-cert/--https-key): bearer "
                        "tokens and prompts cross the network in plaintext", self.settings.host)
