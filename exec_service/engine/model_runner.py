"""The model on its device, ready to serve: one forward per step, through the path that fits the step.

Startup (exec_service.startup) builds every part and hands them over finished; the engine calls ``execute`` once a
step. A decode-only step replays a decode graph, a prefill or mixed step of up to the largest mixed graph's tokens
replays that graph, anything else runs the compiled layers (or the eager model). No step may run Dynamo or
Inductor.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.forward_timer import ForwardTimer
from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.sampler import SampledLogprobs, logprobs, sample
from exec_service.engine.sampling_options import sampling_options
from exec_service.engine.scheduler import ScheduledBatch
from exec_service.engine.sequence import Sequence
from exec_service.engine.step_inputs import StepBuffers
from kiln.step_record import StepPath

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCache:
    """The paged KV cache: per layer ``[2, blocks, block_size, kv_heads, head_dim]``; with a KV window, its last
    block is the null block, which no sequence holds."""

    caches: list[torch.Tensor]
    num_blocks: int  # blocks sequences may hold
    kv_window: int  # kiln.attention.windows.kv_window of the model (0: every block kept)
    scales: list[torch.Tensor] | None = None  # per layer of an FP8 cache (kv_cache.allocate_scales); else None

    @property
    def bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.caches)


@dataclass
class LaunchedStep:
    """A step queued on the device. Its sampled ids stay there as the next step's decode inputs, and come back to
    the host once, in ``token_ids``: the step's only sync."""

    batch: ScheduledBatch
    sampled: torch.Tensor  # [S] int64 on the device, one per sampling entry of the batch
    rows: dict[Sequence, int]  # each sampling sequence's row in ``sampled``
    path: StepPath
    padded_size: int
    timer: ForwardTimer
    host: torch.Tensor  # [S] int64 (pinned on CUDA), where ``sampled`` is copied to
    ready: torch.cuda.Event | None  # recorded after that copy (None on CPU, where the copy is done at once)
    logprobs: SampledLogprobs | None = None  # on the host once ``ready``; when a sequence of the step asked for them
    synced: Callable[[], None] = lambda: None  # ModelForward.step_synced

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        self.synced()
        return self.host.tolist()

    def done(self) -> bool:
        """Whether the device has finished the step (it has on CPU, where steps run as they are launched)."""
        return self.ready is None or self.ready.query()


class ModelRunner:
    def __init__(self, config: EngineConfig, forward: ModelForward, kv_cache: KVCache, buffers: StepBuffers,
                 full_graphs: CUDAGraphs | None = None, mixed_graphs: CUDAGraphs | None = None):
        self.config = config
        self.device = config.device
        self.forward = forward
        self.kv_cache = kv_cache
        self.buffers = buffers
        self.full_graphs = full_graphs
        self.mixed_graphs = mixed_graphs
        # Recorded after each step's copy of its sampled ids, one per host set of the buffers. Waited on by spinning
        # (the GIL released), not by sleeping until the driver wakes the thread: that wake-up cost each step's
        # read-back ~0.2 ms on the H200's host (BENCHMARKS.md, a lone request's TTFT).
        self._ready = [torch.cuda.Event() for _ in range(2)] if self.device == "cuda" else None

    def close(self) -> None:
        self.forward.close()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kv_window(self) -> int:
        return self.kv_cache.kv_window

    def path_of(self, batch: ScheduledBatch) -> tuple[StepPath, int | None]:
        """How ``batch`` runs, and the graph size it is padded to (None: no graph)."""
        if self.full_graphs is not None and batch.is_decode_only:
            padded = self.full_graphs.padded_size(batch.num_seqs)
            if padded is not None:
                return StepPath.FULL_GRAPH, padded
        if self.mixed_graphs is not None:
            padded = self.mixed_graphs.padded_size(batch.num_tokens)
            if padded is not None:
                return StepPath.MIXED_GRAPH, padded
        return (StepPath.EAGER if self.forward.compiled is None else StepPath.COMPILED), None

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step: inputs, forward, logits of the sequences that sample, sampling. Nothing waits here.

        Decodes whose input is ``previous``'s sample (not read back yet) take it from there on the device.
        """
        path, padded = self.path_of(batch)
        inputs, parity = self.buffers.prepare(
            batch, padded if path == StepPath.FULL_GRAPH else None, previous.sampled if previous else None,
            previous.rows if previous else None, padded_tokens=padded if path == StepPath.MIXED_GRAPH else None)
        self.forward.begin_step(inputs.input_ids, inputs.positions, inputs.metadata, path,
                                padded or inputs.num_tokens)
        timer = ForwardTimer(self.device, previous.timer if previous else None,
                             device_idle=previous is None or previous.done())
        with timer:
            if path == StepPath.FULL_GRAPH:
                hidden = self.full_graphs.replay(padded)
            elif path == StepPath.MIXED_GRAPH:
                hidden = self.mixed_graphs.replay(padded)
            else:
                hidden = self.forward(inputs.input_ids, inputs.positions, self.kv_cache.caches, inputs.metadata,
                                      self.kv_cache.scales)
        logits = self.forward.token_model.logits(hidden[inputs.sample_rows])
        options = sampling_options(batch.sampling_entries, inputs.input_ids[inputs.sample_rows], logits.shape[-1])
        sampled = sample(logits, inputs.sampling, options)
        host = self.buffers.sampled_host[parity][:sampled.shape[0]]
        host.copy_(sampled, non_blocking=True)
        host_logprobs = None
        if options is not None and options.num_top_logprobs is not None:
            host_logprobs = logprobs(logits, sampled, options.num_top_logprobs).to_host()
        timer.step_done()
        ready = None
        if self._ready is not None:
            ready = self._ready[parity]
            ready.record()
        rows = {e.seq: row for row, e in enumerate(batch.sampling_entries)}
        return LaunchedStep(batch, sampled, rows, path, padded or inputs.num_tokens, timer, host, ready, host_logprobs,
                            self.forward.step_synced)
