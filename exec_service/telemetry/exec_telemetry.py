"""The execute service's telemetry, assembled in one place from what init_tracing installed in the process.

Forward stats always (GetForwardStats reads them); forward spans and the forward-time histogram when the process
exports (tracing.forward_spans); the batch-size log when KILN_LOG_BATCHSIZE_INTERVAL is set; the request spans,
which the forward spans watch to link each step to the requests it served; and the Prometheus metrics when the
server has a registry for them (--metrics-port). A server started from the CLI, from Python or from a test gets the
same.
"""

from collections.abc import Iterable

from exec_service.telemetry.batch_size_log import BatchSizeLog, log_batchsize_interval
from exec_service.telemetry.forward_stats import ForwardStats
from exec_service.telemetry.metrics import ExecMetrics
from exec_service.telemetry.request_spans import RequestSpans
from kiln.step_record import StepObserver
from tracing.forward_spans import ForwardSpans
from tracing.setup import Telemetry


class ExecTelemetry:
    def __init__(self, telemetry: Telemetry, extra_observers: Iterable[StepObserver] = (),
                 metrics: ExecMetrics | None = None):
        self.forward_stats = ForwardStats()
        self.metrics = metrics
        # Each observer only where it has work: with tracing, the interval and metrics off, a step pays for none.
        self.forward_spans = ForwardSpans(telemetry.resource) if telemetry.enabled else None
        self.request_spans = RequestSpans(watchers=[self.forward_spans] if self.forward_spans else [],
                                          listeners=[metrics.request_ended] if metrics else [])
        self.step_observers: list[StepObserver] = [self.forward_stats]  # first: the batch-size log reads it
        if self.forward_spans:
            self.step_observers.append(self.forward_spans)
        if metrics:
            self.step_observers.append(metrics)
        self.batch_size_log = BatchSizeLog(self.forward_stats) if log_batchsize_interval() is not None else None
        if self.batch_size_log:
            self.step_observers.append(self.batch_size_log)
        self.step_observers += extra_observers

    def close(self) -> None:
        """Once serving stopped: a report being written is finished, and the forward-span writer exports the last
        steps (bounded) and exits."""
        if self.batch_size_log:
            self.batch_size_log.join()
        if self.forward_spans:
            self.forward_spans.close()
