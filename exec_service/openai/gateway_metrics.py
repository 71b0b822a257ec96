"""The gateway's own Prometheus metrics: requests by endpoint and HTTP status, time to first token, inter-token
latency and end-to-end latency as the HTTP client sees them (the execute services' metrics say where inside that
time went)."""

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram

from protos import exec_pb2

# Seconds: vLLM's buckets for time to first token and end-to-end latency, so dashboards read both alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter("kiln:api_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.ttft = Histogram("kiln:api_time_to_first_token_seconds",
                              "Seconds from a request's arrival at the gateway to its first token",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("kiln:api_inter_token_latency_seconds",
                             "Seconds between successive messages of one sequence, as they reach the gateway",
                             ["endpoint"], buckets=ITL_BUCKETS, registry=registry)
        self.latency = Histogram("kiln:api_e2e_request_latency_seconds",
                                 "Seconds from a request's arrival at the gateway to its last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def first_token(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint).observe(seconds)

    def finished(self, endpoint: str, seconds: float) -> None:
        self.latency.labels(endpoint).observe(seconds)

    async def gaps(self, endpoint: str, first: tuple[int, exec_pb2.GenerateResponse], first_s: float,
                   responses: AsyncIterator[tuple[int, exec_pb2.GenerateResponse]]
                   ) -> AsyncIterator[tuple[int, exec_pb2.GenerateResponse]]:
        """``responses`` passed through, each sequence's gap since its previous message observed."""
        last = {(first[0], first[1].index): first_s}
        async for prompt, response in responses:
            now, sequence = time.perf_counter(), (prompt, response.index)
            if sequence in last and response.token_ids:
                self.itl.labels(endpoint).observe(now - last[sequence])
            last[sequence] = now
            yield prompt, response
