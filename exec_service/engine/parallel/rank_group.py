"""The other ranks of a tensor-parallel model as rank 0 holds them: their processes, watched, and the process groups.

A rank that exits on its own makes the model lost: rank 0's next collective fails at once (gloo sees the closed
connection), and the reason names the rank and its exit status. On CUDA the NCCL group is aborted as well: an NCCL
kernel waiting for a dead peer (in a step already queued, or a CUDA graph, which no watchdog times out) waits
forever otherwise; aborted, it returns and the step's sync with it.

The abort runs on a thread of its own, as vLLM's does (vllm-project/vllm#39846): NCCL lets go of a communicator only
once every CUDA graph that captured its calls is destroyed, and the model's graphs go with its runner, later; the
abort's first act, which ends the kernels in flight, does not wait for that.
"""

import datetime
import logging
import subprocess
import threading
import time

import torch.distributed as dist

from exec_service.engine.parallel import step_broadcast
from kiln.errors import first_line

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # for the ranks to leave their loop once told to stop, before they are killed
EXIT_WAIT_S = 1.0  # after a failed collective, for a dying rank's exit status, which says more than gloo's error


class RankGroup:
    def __init__(self, name: str, control: dist.ProcessGroup, collective: dist.ProcessGroup,
                 processes: list[subprocess.Popen]):
        self.name = name
        self.control = control  # gloo: the step broadcast's header, the KV agreement, stop
        self.collective = collective  # the sharded layers' all-reduce: NCCL on CUDA, the gloo group on the CPU
        self.processes = processes  # ranks 1..N-1, in order
        self.lost: str | None = None  # why the model cannot step any more, once it cannot
        self._closing = False
        self._aborted = False
        self._abort_lock = threading.Lock()  # a watcher thread and the engine's may lose the model at once
        for rank, process in enumerate(processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), name=f"rank{rank}-{name}",
                             daemon=True).start()

    @property
    def size(self) -> int:
        return len(self.processes) + 1

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self._closing:
            self.lose(f"rank {rank} of {self.size} (pid {process.pid}) exited with status {code}")

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            log.error("%s: %s; the model is lost", self.name, reason)
            self._abort_collective()

    def _abort_collective(self) -> None:
        with self._abort_lock:
            if self.collective is not self.control and not self._aborted:
                self._aborted = True
                threading.Thread(target=self.collective.abort, name=f"nccl-abort-{self.name}", daemon=True).start()

    def failed(self, exc: Exception) -> None:
        """A collective failed: the model is lost, for the rank that exited when one did."""
        self.lose(self.exited() or f"a step failed across the ranks: {first_line(exc)}")

    def exited(self) -> str | None:
        """Which rank is gone and its status, waiting up to EXIT_WAIT_S for a dying one; None when all run."""
        deadline = time.monotonic() + EXIT_WAIT_S
        for rank, process in enumerate(self.processes, start=1):
            try:
                code = process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            return f"rank {rank} of {self.size} (pid {process.pid}) exited with status {code}"
        return None

    def abandon(self) -> None:
        """The load failed after the join: end every rank now (one may be inside a collective, deaf to stop)."""
        self._closing = True
        for process in self.processes:
            process.kill()
            process.wait()
        self._abort_collective()

    def close(self) -> None:
        """Tell the ranks to stop (when they still listen), then end any that has not within the grace."""
        if self._closing:
            return
        self._closing = True
        if self.lost is None:
            try:
                step_broadcast.send_stop(self.control, datetime.timedelta(seconds=STOP_GRACE_S))
            except RuntimeError as exc:
                log.warning("%s: the ranks did not hear stop: %s", self.name, exc)
        for process in self.processes:
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("%s: rank pid %d did not stop; killing it", self.name, process.pid)
                process.kill()
                process.wait()
        self._abort_collective()  # the peers are gone: the NCCL communicator goes once the graphs do
