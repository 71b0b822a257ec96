"""``--metrics-port``, the same on every server: Prometheus ``/metrics`` on an HTTP port of its own, bound to the
server's ``--host``."""

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry

from tracing.metrics_port import MetricsPort, serve_metrics

T = TypeVar("T")


def add_metrics_arg(p) -> None:
    # A string default goes through ``type`` too: a bad KILN_METRICS_PORT is a usage error of this command only.
    p.add_argument("--metrics-port", type=_port, default=os.environ.get("KILN_METRICS_PORT") or None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (env KILN_METRICS_PORT; default: off)")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {text!r}")
    return port


@dataclass
class ServedMetrics(Generic[T]):
    collector: T  # what the server feeds
    port: MetricsPort

    def close(self) -> None:
        self.port.close()


def start_metrics(args, collector: Callable[[CollectorRegistry], T]) -> ServedMetrics[T] | None:
    """With ``--metrics-port``: ``collector`` built on a fresh registry, served on that port; None without."""
    if not args.metrics_port:
        return None
    registry = CollectorRegistry()
    built = collector(registry)
    return ServedMetrics(built, serve_metrics(registry, args.host, args.metrics_port))
