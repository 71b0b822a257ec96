"""The compile service's Prometheus metrics: compiles by result and their seconds, phase by phase.

Fed by the Compile RPC as each one ends; everything lives in the registry it is given: one per server.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram

from compile_service.pipeline import CompileOutcome

# A cache hit is milliseconds; a cold compile of a large model, many minutes.
COMPILE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
                   3600.0)


class CompileMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.compiles = Counter("kiln:compiles", "Compile requests by result: compiled, cache_hit, or the gRPC "
                                "status of the failure", ["result"], registry=registry)
        self.seconds = Histogram("kiln:compile_seconds", "Seconds of a Compile, by result (compiled or cache_hit)",
                                 ["result"], buckets=COMPILE_BUCKETS, registry=registry)
        self.phase_seconds = Histogram("kiln:compile_phase_seconds", "Seconds of each phase of a compile that ran "
                                       "(trace, split, inductor, save, ...)", ["phase"], buckets=COMPILE_BUCKETS,
                                       registry=registry)

    def compiled(self, outcome: CompileOutcome) -> None:
        result = "cache_hit" if outcome.cache_hit else "compiled"
        self.compiles.labels(result).inc()
        self.seconds.labels(result).observe(outcome.total_s)
        if not outcome.cache_hit:
            for phase, seconds in outcome.timings.items():
                self.phase_seconds.labels(phase).observe(seconds)

    def failed(self, status: str) -> None:
        self.compiles.labels(status).inc()
