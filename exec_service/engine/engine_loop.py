"""The serving loop of one model, in its own thread: schedule → launch → read the previous step → stream.

The device never waits for Python: step N+1 is scheduled, its inputs prepared and its forward and sampling queued
while step N runs, and only then does the loop read step N's sampled tokens (the one sync per step), append them,
and stream them (vLLM's async scheduling, SGLang's overlap scheduler). Step N+1's decodes take their input tokens
from step N's output on the device; a sequence that step N finished or a client cancelled wastes one slot of step
N+1, whose token is dropped. When step N is already done by the time step N+1 would be scheduled (the host is the
slower one, as on a CPU), nothing is overlapped any more: step N is read first, so its tokens are not held back by
step N+1's preparation. Requests and cancellations arrive from the event loop through an inbox and are applied
between steps. Each step's tokens go back to the Generate handlers through their RequestStreams; a step that fails
fails its requests only, and the loop goes on. With a stream interval of n > 1, a sequence's tokens after its first
are held here until n have gathered (or it ends), so each handler wakes, and each client gets a message, once per n
tokens rather than once per step: at high concurrency the handlers' event loop competes with this thread for the
host (vLLM's --stream-interval).

A request for n sequences of one prompt is one sequence first: the n-1 others wait here until its first token is
read, so its prompt's KV has been computed before theirs is scheduled, and prefix caching can hand them its blocks
rather than recompute them. Each sequence samples with its own seed, so none depends on when the others ran.
"""

import asyncio
import logging
import random
import threading
from dataclasses import dataclass

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.kv.block_manager import BlockManager
from exec_service.engine.model_runner import LaunchedStep, ModelRunner
from exec_service.engine.request_stream import RequestOutput, RequestStream, deliver
from exec_service.engine.scheduler import ScheduledBatch, Scheduler
from exec_service.engine.sequence import FinishReason, Sequence
from kiln.errors import Internal, KilnError, ResourceExhausted, Unavailable, first_line, resource_error
from kiln.step_record import StepObserver, StepRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewRequest:
    """Inbox message: a request's sequences to schedule (one, or n of one prompt), and where their tokens go."""

    seqs: list[Sequence]
    stream: RequestStream


@dataclass(frozen=True)
class Cancel:
    """Inbox message: a request to abort, every sequence of it, before the next step."""

    request_id: str


@dataclass(frozen=True)
class EndSequence:
    """Inbox message: one sequence to finish with STOP before the next step (a stop string matched its text)."""

    seq: Sequence


InboxMessage = NewRequest | Cancel | EndSequence


class ModelLost(Unavailable):
    """The model cannot step any more (a rank of a tensor-parallel model died, or the ranks fell out of step): the
    engine ends every request it holds with this, and refuses new ones."""


class Engine:
    def __init__(self, name: str, runner: ModelRunner, config: EngineConfig, eos_token_ids: frozenset[int],
                 step_observers: list[StepObserver] | None = None, prefix_root: bytes | None = None):
        self.name = name
        self.runner = runner
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.step_observers: list[StepObserver] = step_observers if step_observers is not None else []
        # prefix_root: block_hash.model_root of the model served, or None to turn prefix caching off.
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, runner.kv_window, prefix_root)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._seeds = random.Random()  # noise seeds for requests that bring none
        self._streams: dict[Sequence, RequestStream] = {}
        self._unsent: dict[Sequence, RequestOutput] = {}  # tokens held back by the stream interval
        self._inbox: list[InboxMessage] = []
        self._held: dict[Sequence, list[Sequence]] = {}  # a request's first sequence -> the others, until its token
        self._num_held = 0  # read on the event loop (num_waiting), so not summed over _held there
        self._wakeup = threading.Condition()
        self._stopping = False
        self._previous_step_end_ns: int | None = None  # the last step read: its end, for the next one's host wait
        self.failure: KilnError | None = None  # why the engine thread stopped by itself (a bug outside a step)
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, error: KilnError | None = None) -> None:
        """Finish the step in flight, then end every request with ``error`` (default: UNAVAILABLE, unloaded)."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()
        self.runner.close()
        self._end_all(error or Unavailable(f"model: {self.name!r} was unloaded"))

    def _end_all(self, error: KilnError) -> None:
        """End every request the engine holds, queued or scheduled, with ``error``."""
        inbox, self._inbox = self._inbox, []
        for message in inbox:
            if isinstance(message, NewRequest):
                message.stream.put(RequestOutput(error=error))
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._end(seq, RequestOutput(error=error))

    # Called on the event loop.

    def add_request(self, seq: Sequence, siblings: list[Sequence] | tuple = ()) -> RequestStream:
        """Queue a request for the next step; RESOURCE_EXHAUSTED when it can never fit or the queue is full.

        ``siblings``: the request's other sequences of the same prompt (n > 1), scheduled once ``seq``'s first token
        is read; the stream carries all of them, each output with its sequence's index."""
        blocks = self.block_manager
        needed = blocks.max_blocks_held(seq.max_kv_tokens, self.config.max_num_batched_tokens)
        if needed > blocks.num_blocks:
            at_once = f" at once (a KV window of {blocks.window} tokens)" if blocks.window else ""
            raise ResourceExhausted(
                f"prompt_ids + max_tokens: {seq.max_kv_tokens} tokens need {needed} KV blocks{at_once}, the cache of "
                f"{self.name!r} has {blocks.num_blocks}")
        seqs = [seq, *siblings]
        for each in seqs:
            if each.params.seed is None:
                each.noise_seed = self._seeds.getrandbits(63)
        stream = RequestStream(asyncio.get_running_loop(), len(seqs))
        with self._wakeup:
            if self._stopping:
                raise self.failure or Unavailable(f"model: {self.name!r} is being unloaded")
            if self.num_waiting + len(seqs) > self.config.max_num_waiting:
                raise ResourceExhausted(f"model: {self.name!r} has {self.num_waiting} of its max_num_waiting "
                                        f"{self.config.max_num_waiting} sequences waiting, no room for {len(seqs)} "
                                        f"more; retry later")
            self._inbox.append(NewRequest(seqs, stream))
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request, every sequence of it: their blocks are freed before the next step. A no-op when it
        already finished."""
        with self._wakeup:
            self._inbox.append(Cancel(request_id))
            self._wakeup.notify()

    def end_sequence(self, seq: Sequence) -> None:
        """Finish one sequence with STOP before the next step (a stop string matched its text): no more tokens."""
        with self._wakeup:
            self._inbox.append(EndSequence(seq))
            self._wakeup.notify()

    @property
    def num_waiting(self) -> int:
        inbox = sum(len(m.seqs) for m in self._inbox if isinstance(m, NewRequest))
        return len(self.scheduler.waiting) + inbox + self._num_held

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def peak_used_blocks(self) -> int:
        return self.block_manager.peak_used_blocks

    # The engine thread.

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - a bug outside a step (scheduling, bookkeeping): never a hang
            if isinstance(exc, ModelLost):
                log.error("%s: the engine stopped: %s", self.name, exc)
                failure = exc
            else:
                log.exception("%s: the engine stopped", self.name)
                failure = Internal(f"model {self.name!r}: its engine stopped ({first_line(exc)}); load it again")
            with self._wakeup:
                self._stopping, self.failure = True, failure
                self._end_all(failure)
            self.runner.close()

    def _serve(self) -> None:
        in_flight: LaunchedStep | None = None
        while True:
            with self._wakeup:
                while not self._inbox and not self.scheduler.has_work and in_flight is None and not self._stopping:
                    self._previous_step_end_ns = None  # the next step waited for work, not for the host
                    self._wakeup.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            for message in inbox:
                match message:
                    case NewRequest(seqs, stream):
                        self._admit(seqs, stream)
                    case Cancel(request_id):
                        self._abort(request_id)
                    case EndSequence(seq):
                        self._end_sequence(seq)
            if in_flight is not None and in_flight.done():
                # The device already ran it: its tokens go out now, not after the next step's inputs and launch
                # (a lone request's first token waited for them), and the next step decodes them from the host.
                self._finish(in_flight)
                in_flight = None
            batch = self.scheduler.schedule()
            launched, failure = None, None
            if batch.entries:
                try:
                    launched = self.runner.execute(batch, in_flight)
                except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
                    failure = exc
            if in_flight is not None:
                self._finish(in_flight)
            if isinstance(failure, ModelLost):
                raise failure
            if failure is not None:  # after the step before it, so what that step finished ends normally
                self._fail(batch, failure)
            in_flight = launched
        if in_flight is not None:
            self._finish(in_flight)

    def _admit(self, seqs: list[Sequence], stream: RequestStream) -> None:
        first, *others = seqs
        for seq in seqs:
            self._streams[seq] = stream
        self.scheduler.add(first)
        if others:
            self._held[first] = others
            self._num_held += len(others)

    def _release_held(self, seq: Sequence) -> list[Sequence]:
        """The sequences waiting for ``seq``'s first token, no longer waiting."""
        others = self._held.pop(seq, [])
        self._num_held -= len(others)
        return others

    def _abort(self, request_id: str) -> None:
        cancelled = False
        while (seq := self.scheduler.abort(request_id)) is not None:  # each of its sequences still scheduled
            cancelled = True
            self._release_held(seq)
        for seq in [seq for seq in self._streams if seq.request_id == request_id]:
            del self._streams[seq]
            self._unsent.pop(seq, None)
        if cancelled:
            log.info("%s: request %s cancelled", self.name, request_id)

    def _end_sequence(self, seq: Sequence) -> None:
        if not seq.is_finished:
            seq.finish(FinishReason.STOP)
            self.scheduler.drop(seq)
        self._streams.pop(seq, None)
        self._unsent.pop(seq, None)  # a stop string ended it on the event loop: what followed is not sent
        for sibling in self._release_held(seq):  # none once it has output, but never left waiting for it
            self.scheduler.add(sibling)

    def _finish(self, step: LaunchedStep) -> None:
        """Read a launched step's tokens (the sync), append them and hand them to their streams."""
        try:
            token_ids = step.token_ids()
        except Exception as exc:  # noqa: BLE001 - the device failed while it ran the step
            if isinstance(exc, ModelLost):  # a rank was lost while it ran: every request ends, not this step's
                raise
            self._fail(step.batch, exc)
            return
        # Observed before any request hears of its tokens: a request's span is still live when its last step's
        # forward span links to it.
        self._observe(step, step.timer.start_ns, step.timer.elapsed_ms(), step.timer.step_end_ns)
        outputs = []
        for entry, token_id in self.scheduler.postprocess(step.batch, token_ids):
            seq = entry.seq
            logprobs = None
            if seq.params.logprobs:
                logprobs = [step.logprobs.of_row(step.rows[seq], token_id, seq.params.top_logprobs)]
            if seq.is_finished:
                stream, output = self._streams.pop(seq, None), RequestOutput(
                    [token_id], seq.finish_reason, seq.usage(), index=seq.index, logprobs=logprobs)
            else:
                stream, output = self._streams.get(seq), RequestOutput([token_id], index=seq.index,
                                                                       logprobs=logprobs)
            if stream is not None and (output := self._paced(seq, output)) is not None:
                outputs.append((stream, output))
            for sibling in self._release_held(seq):  # its prompt's KV is computed: the others may reuse it now
                self.scheduler.add(sibling)
        deliver(outputs)

    def _paced(self, seq: Sequence, output: RequestOutput) -> RequestOutput | None:
        """``output`` with the tokens held back before it, when it is to be sent now: the sequence's first token,
        its last output, or stream_interval tokens gathered; None while it is held."""
        held = self._unsent.pop(seq, None)
        if held is not None:
            output = held.then(output)
        if (output.is_last or len(output.token_ids) >= self.config.stream_interval
                or seq.num_tokens - seq.num_prompt_tokens == 1):
            return output
        self._unsent[seq] = output
        return None

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> None:
        """End the step's requests that are still live with INTERNAL and free their blocks."""
        log.error("%s: step of %d sequences failed", self.name, batch.num_seqs, exc_info=exc)
        error = resource_error(exc, "forward") or Internal(f"forward failed: {first_line(exc)}")
        self._previous_step_end_ns = None  # the failed step's time is no wait for the host
        self.block_manager.forget_cached()  # the failed step's blocks were registered, maybe never written
        for entry in batch.entries:
            if not entry.seq.is_finished:
                self.scheduler.drop(entry.seq)
                self._end(entry.seq, RequestOutput(error=error))

    def _end(self, seq: Sequence, output: RequestOutput) -> None:
        """End ``seq``'s request with an error; the request's sequences still held go with it."""
        stream = self._streams.pop(seq, None)
        for sibling in self._release_held(seq):
            self._streams.pop(sibling, None)
        # The tokens its request's sequences have had and the stream interval held back go out before the error.
        unsent = [self._unsent.pop(s) for s in [s for s in self._unsent if s.request_id == seq.request_id]]
        if stream is not None:
            deliver([(stream, each) for each in (*unsent, output)])

    def _observe(self, step: LaunchedStep, start_ns: int, forward_ms: float, step_end_ns: int) -> None:
        previous_end_ns, self._previous_step_end_ns = self._previous_step_end_ns, step_end_ns
        if not self.step_observers:
            return
        batch = step.batch
        host_wait_ns = -1 if previous_end_ns is None else max(0, start_ns - previous_end_ns)
        record = StepRecord(
            model=self.name, batch_size=batch.num_seqs, num_tokens=batch.num_tokens, padded_size=step.padded_size,
            runtime_mode=self.config.runtime_mode.value, path=step.path.value, phase=batch.phase, start_ns=start_ns,
            end_ns=start_ns + int(forward_ms * 1e6), request_ids=tuple(e.seq.request_id for e in batch.entries),
            host_wait_ns=host_wait_ns)
        for observer in self.step_observers:
            try:
                observer(record)
            except Exception:  # noqa: BLE001 - telemetry never stops serving
                log.exception("%s: step observer %r failed", self.name, observer)

