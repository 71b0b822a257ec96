"""The model on its device: weights, the KV cache, the compiled function, CUDA graphs, and one forward per step.

The startup phases (exec_service.startup.load_model) fill it in order: weights, the eager memory profile, the KV
cache, the compiled function, CUDA graphs; the engine then calls ``execute`` once a step. Neither the load nor any
step may run Dynamo or Inductor: ``expect_no_compile`` raises if the counters move.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from exec_service.engine import kv_cache
from exec_service.engine.cuda_graphs import CUDAGraphs
from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.forward_timer import ForwardTimer
from exec_service.engine.sampler import SampledLogprobs, logprobs, sample
from exec_service.engine.sampling_options import sampling_options
from exec_service.engine.scheduler import ScheduledBatch
from exec_service.engine.sequence import Sequence
from exec_service.engine.step_inputs import StepBuffers
from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.attention.windows import kv_window, layer_windows
from kiln.compilation.counters import expect_no_compile
from kiln.errors import FailedPrecondition, first_line
from kiln.model.causal_lm import TokenModel, build_model, weights_bytes
from kiln.model.spec import ResolvedModel
from kiln.runtime_mode import RuntimeMode
from kiln.store import bundle
from kiln.store.signing import TrustedKeys

log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step queued on the device. Its sampled ids stay there as the next step's decode inputs, and come back to
    the host once, in ``token_ids``: the step's only sync."""

    batch: ScheduledBatch
    sampled: torch.Tensor  # [S] int64 on the device, one per sampling entry of the batch
    rows: dict[Sequence, int]  # each sampling sequence's row in ``sampled``
    runtime_mode: RuntimeMode
    padded_size: int
    timer: ForwardTimer
    host: torch.Tensor  # [S] int64 (pinned on CUDA), where ``sampled`` is copied to
    ready: torch.cuda.Event | None  # recorded after that copy (None on CPU, where the copy is done at once)
    logprobs: SampledLogprobs | None = None  # on the host once ``ready``; when a sequence of the step asked for them

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def done(self) -> bool:
        """Whether the device has finished the step (it has on CPU, where steps run as they are launched)."""
        return self.ready is None or self.ready.query()


class ModelRunner:
    def __init__(self, resolved: ResolvedModel, config: EngineConfig):
        self.resolved = resolved
        self.config = config
        self.device = config.device
        self.token_model: TokenModel | None = None
        self.weights_bytes = 0
        self.kv_window = 0  # kiln.attention.windows.kv_window of the model, known once its weights are loaded
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0  # blocks sequences may hold (with a KV window, the cache has one more: the null block)
        self.compiled = None
        self.cudagraphs: CUDAGraphs | None = None
        self.buffers: StepBuffers | None = None
        # Recorded after each step's copy of its sampled ids, one per host set of the buffers.
        self._ready = [torch.cuda.Event(blocking=True) for _ in range(2)] if self.device == "cuda" else None

    def load_weights(self, weights: str, seed: int) -> int:
        self.token_model = build_model(self.resolved, self.device, weights, seed)
        self.weights_bytes = weights_bytes(self.token_model)
        window = kv_window(layer_windows(self.token_model, self.device))
        # A window that no sequence outgrows by a whole block never lets one go: then there is no null block either.
        self.kv_window = window if window + self.config.block_size <= self.config.max_model_len else 0
        return self.weights_bytes

    @property
    def kv_cache_spec(self) -> kv_cache.KVCacheSpec:
        return kv_cache.KVCacheSpec.from_config(self.resolved.config, self.config.block_size, self.resolved.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """A cache of ``num_blocks`` blocks; with a KV window its last one is the null block (BlockManager)."""
        self.num_blocks = num_blocks - 1 if self.kv_window else num_blocks
        self.kv_caches = kv_cache.allocate(self.kv_cache_spec, num_blocks, self.device)
        self.buffers = StepBuffers(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   self.config.max_blocks_per_seq, self.config.block_size,
                                   self.resolved.config.vocab_size, self.device)
        window = f", KV window {self.kv_window} tokens (+1 null block)" if self.kv_window else ""
        log.info("# %s blocks: %d%s", "GPU" if self.device == "cuda" else "CPU", self.num_blocks, window)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    def load_compiled(self, bundle_dir: Path, key: str, trusted: TrustedKeys) -> None:
        """Load the bundle's function once its signature verifies, compiling nothing."""
        with expect_no_compile("loading the compiled function"):
            try:
                self.compiled = bundle.load_compiled(bundle_dir, key, trusted)
            except (RuntimeError, AssertionError) as exc:
                raise FailedPrecondition(f"bundle {bundle_dir.name[:12]}: torch refused to load it: "
                                         f"{first_line(exc)}") from exc

    @torch.no_grad()
    def warm_up_compiled(self) -> None:
        """The first call at a token count does one-off work (kernel loads, launch setup): pay it here for the
        smallest and the largest step, not in a request's step (BENCHMARKS.md, startup and throughput)."""
        with expect_no_compile("warming up the compiled function"):
            for tokens in sorted({min(2, self.config.max_num_batched_tokens), self.config.max_num_batched_tokens}):
                self.compiled(self.token_model, torch.zeros(tokens, dtype=torch.int64, device=self.device),
                              torch.arange(tokens, device=self.device))
            self.compiled.skip_guard_checks()  # every layer's weights passed torch's guards just now

    @torch.no_grad()
    def warm_up_paged_attention(self) -> None:
        """A two-token prefill, then one decode step, of one sequence through the paged KV cache: the attention
        kernels are built here (Triton's JIT), not in a request's first step. The sequence sits
        in the first blocks, which hold nothing yet; every real token's KV is written before it is read."""
        blocks = -(-3 // self.config.block_size)
        if self.num_blocks < blocks:
            return
        table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None, :]
        for start, end in ((0, 2), (2, 3)):
            positions = torch.arange(start, end, device=self.device)
            metadata = AttentionMetadata(
                slot_mapping=positions, query_start_loc=torch.tensor([0, end - start], dtype=torch.int32,
                                                                     device=self.device),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=self.device), block_tables=table,
                max_query_len=end - start, num_seqs=1)
            self._forward(torch.zeros_like(positions), positions, metadata)

    def capture_cudagraphs(self, on_captured: Callable[[int, int], None]) -> float:
        self.cudagraphs = CUDAGraphs(self._compiled_forward, self.config.capture_sizes, self.buffers,
                                     self.resolved.config.hidden_size, self.resolved.dtype, torch.device(self.device))
        with torch.no_grad(), expect_no_compile("CUDA-graph capture"):
            return self.cudagraphs.capture(self.kv_caches, on_captured)

    def _compiled_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.compiled(self.token_model, input_ids, positions)

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step: inputs, forward, logits of the sequences that sample, sampling. Nothing waits here.

        Decodes whose input is ``previous``'s sample (not read back yet) take it from there on the device.
        """
        padded = self.cudagraphs.padded_size(batch.num_seqs, batch.is_decode_only) if self.cudagraphs else None
        inputs, parity = self.buffers.prepare(batch, padded, previous.sampled if previous else None,
                                              previous.rows if previous else None)
        timer = ForwardTimer(self.device, previous.timer if previous else None,
                             device_idle=previous is None or previous.done())
        with timer:
            if padded is not None:
                hidden = self.cudagraphs.replay(padded)
            else:
                hidden = self._forward(inputs.input_ids, inputs.positions, inputs.metadata)
        logits = self.token_model.logits(hidden[inputs.sample_rows])
        options = sampling_options(batch.sampling_entries, inputs.input_ids[inputs.sample_rows], logits.shape[-1])
        sampled = sample(logits, inputs.sampling, options)
        host = self.buffers.sampled_host[parity][:sampled.shape[0]]
        host.copy_(sampled, non_blocking=True)
        host_logprobs = None
        if options is not None and options.num_top_logprobs is not None:
            host_logprobs = logprobs(logits, sampled, options.num_top_logprobs).to_host()
        ready = None
        if self._ready is not None:
            ready = self._ready[parity]
            ready.record()
        mode = RuntimeMode.CUDAGRAPH if padded is not None else RuntimeMode.EAGER if self.compiled is None \
            else RuntimeMode.COMPILED
        rows = {e.seq: row for row, e in enumerate(batch.sampling_entries)}
        return LaunchedStep(batch, sampled, rows, mode, padded or inputs.num_tokens, timer, host, ready, host_logprobs)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        with forward_context(ForwardContext(self.kv_caches, metadata)):
            if self.compiled is None:
                return self.token_model(input_ids, positions)
            return self._compiled_forward(input_ids, positions)
