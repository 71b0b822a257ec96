"""One ``forward`` span per engine step, timed by the engine's own clock, and the forward-time histogram.

An engine step observer: the engine calls it with each step's StepRecord (kiln.step_record) after the step's own
sync, so reading the times costs no extra device sync. It also hears when each request's span starts and ends (the
execute service's request spans call ``request_started`` / ``request_ended``), so a step's span can link to the
requests it served. The spans themselves are built and exported by a writer process (tracing.forward_span_writer,
which says why).
"""

import logging
import multiprocessing
import os
import queue
import threading
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanContext

from kiln.step_record import StepRecord
from tracing import forward_span_writer
from tracing.forward_span_writer import REQUEST_ENDED, REQUEST_STARTED, STEP
from tracing.setup import SHUTDOWN_TIMEOUT_S

log = logging.getLogger(__name__)

# Messages waiting for the sender thread; past this, steps are counted in ``dropped`` rather than slowing the engine.
PENDING_LIMIT = 10_000
# The sender wakes this often and ships what piled up as one message, so it takes the GIL 20 times a second
# rather than once a step.
SEND_INTERVAL_S = 0.05


def forward_span_ratio() -> float:
    """KILN_FORWARD_SPAN_RATIO: the fraction of steps that get a span (default 1.0), so busy servers can thin them."""
    value = os.environ.get("KILN_FORWARD_SPAN_RATIO", "1.0")
    try:
        ratio = float(value)
    except ValueError:
        raise ValueError(f"KILN_FORWARD_SPAN_RATIO: {value!r} is not a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"KILN_FORWARD_SPAN_RATIO: {ratio} is not in [0, 1]")
    return ratio


class EvenSampler:
    """Step n is sampled when floor(n * ratio) moves: ratio 0.25 is every 4th step, deterministic."""

    def __init__(self, ratio: float):
        self.ratio = ratio
        self._steps = 0

    def __call__(self) -> bool:
        before = int(self._steps * self.ratio)
        self._steps += 1
        return int(self._steps * self.ratio) > before


class ForwardSpans:
    """Step observer and request watcher: a span for ``ratio`` of the steps, evenly spaced, linked to the requests
    it served; the histogram for every step.

    The engine thread and the Generate handlers only queue plain values (a step costs microseconds); a sender
    thread ships the queue to the writer process, which exports as ``resource``. Call close() (or stop(), then
    join()) before the process exits, so the last steps are exported.
    """

    def __init__(self, resource: Resource, ratio: float | None = None):
        self._sampled = EvenSampler(forward_span_ratio() if ratio is None else ratio)
        self.dropped = 0
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = threading.Event()
        spawn = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
        reader, self._pipe = spawn.Pipe(duplex=False)
        self._writer = spawn.Process(
            target=forward_span_writer.serve, name="kiln-forward-spans", daemon=True,
            args=(reader, dict(resource.attributes), logging.getLogger().getEffectiveLevel()))
        self._writer.start()
        reader.close()  # the writer holds the only read end: it sees the end of the pipe if this process dies
        self._sender = threading.Thread(target=self._send, name="forward-spans", daemon=True)
        self._sender.start()

    def __call__(self, step: StepRecord) -> None:
        if self._closing.is_set():
            return
        sampled = self._sampled()
        if self._pending.qsize() >= PENDING_LIMIT:
            if not self.dropped:
                log.warning("forward spans: the writer is %d messages behind; dropping steps until it catches up",
                            PENDING_LIMIT)
            self.dropped += 1
            return
        self._pending.put((STEP, step if sampled else step._replace(request_ids=()), sampled))

    def request_started(self, request_id: str, context: SpanContext) -> None:
        if self._closing.is_set():
            return
        self._pending.put((REQUEST_STARTED, request_id, context.trace_id, context.span_id, int(context.trace_flags)))

    def request_ended(self, request_id: str) -> None:
        if self._closing.is_set():
            return
        self._pending.put((REQUEST_ENDED, request_id))

    def stop(self) -> None:
        """Take no more steps; the queued ones are shipped and the writer exports them and exits. Returns at once,
        so the caller's own exporters can flush meanwhile; join() waits."""
        self._closing.set()

    def join(self, timeout_s: float = SHUTDOWN_TIMEOUT_S + 2) -> None:
        """Wait for the writer's last export (bounded by its own SHUTDOWN_TIMEOUT_S); past ``timeout_s`` kill it."""
        deadline = time.monotonic() + timeout_s
        self._sender.join(timeout_s)
        self._writer.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():
            log.warning("the forward-span writer did not finish in %.0f s; stopping it", timeout_s)
            self._writer.kill()
            self._writer.join()

    def close(self) -> None:
        self.stop()
        self.join()

    def _send(self) -> None:
        try:
            while True:
                closing = self._closing.wait(SEND_INTERVAL_S)
                batch = self._drain()
                if batch:
                    self._pipe.send(batch)
                if closing:
                    self._pipe.send(None)
                    return
        except OSError:  # BrokenPipeError included
            log.warning("the forward-span writer exited (code %s); forward spans and the forward-time histogram "
                        "are off", self._writer.exitcode)
            self._closing.set()
        finally:
            self._pipe.close()

    def _drain(self) -> list:
        batch = []
        try:
            while True:
                batch.append(self._pending.get_nowait())
        except queue.Empty:
            return batch
