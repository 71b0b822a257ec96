"""Bringing one model up, phase by phase: fetch, load weights, profile memory, load compiled, capture CUDA graphs.

Each phase is timed, logged, reported to the LoadModel stream as it ends, and a span under ``load_model`` with what
it measured. The order is the contract: the memory profile runs on the eager model before the compiled function is
loaded.
"""

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from opentelemetry import trace

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.engine_loop import Engine, StepObserver
from exec_service.engine.kv import block_hash, kv_cache
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.model_runner import KVCache, ModelRunner
from exec_service.engine.parallel.tensor_parallel_forward import TensorParallelForward
from exec_service.engine.step_inputs import StepBuffers
from exec_service.startup import kv_sizing
from exec_service.startup.compiled_function import (
    load_compiled,
    warm_up_blocks,
    warm_up_compiled,
    warm_up_paged_attention,
)
from exec_service.startup.fetch import BundleFetcher, FetchedBundle, StepFn
from exec_service.startup.graph_capture import CapturedGraphs, capture_graphs
from exec_service.startup.memory_profile import profile_memory
from exec_service.startup.ranks import StartingRanks
from exec_service.startup.weights import LoadedWeights, load_weights
from kiln.compilation.config import CompileConfig
from kiln.errors import InvalidArgument, KilnError, Unavailable, quote, resource_error
from kiln.model.roots import PinnedDir
from kiln.model.spec import ResolvedModel
from kiln.runtime_mode import RuntimeMode
from protos import common_pb2
from tracing import spans

log = logging.getLogger(__name__)

_DEVICE_PHASES = threading.Lock()

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class LoadTarget:
    """A LoadModelRequest, validated (exec_service.api.load_request): what to load and how to serve it."""

    name: str  # what clients call it in Generate
    spec: common_pb2.ModelSpec  # as the client named it; sent on to the compile service on a miss
    resolved: ResolvedModel  # its HF config and dtype
    compile_config: CompileConfig
    key: str | None
    engine_config: EngineConfig
    weights: str
    weights_seed: int
    weights_dir: PinnedDir | None = None  # holds open the files of ``weights`` that its check opened


@dataclass
class StartupPhase:
    """One phase as it ends, or progress inside it: a LoadModel stream event (api/messages.py makes the message)."""

    phase: str  # fetch, load_weights, profile_memory, load_compiled, capture_cudagraphs, ready
    seconds: float = 0.0  # on progress, the step's (0 when it names none)
    detail: str = ""  # a line for a person, e.g. "# GPU blocks: 27846"
    progress: bool = False
    step: str = ""  # on progress: the step of the phase that just ended (verify, unpickle, warm_up, ...)


EmitFn = Callable[[StartupPhase], None]


@dataclass(frozen=True)
class ModelSizing:
    """What startup sized and chose: LoadModel's last event, and each ready model's entry in ListModels."""

    key: str  # the bundle served; "" in eager mode
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    cudagraph_bytes: int  # measured as the CUDA graphs (full and piecewise) were captured
    total_memory_bytes: int  # 0 on CPU
    capture_sizes: tuple[int, ...]
    runtime_mode: RuntimeMode
    device: str
    timings: tuple[tuple[str, float], ...]  # every phase with its seconds
    vocab_size: int
    kv_window: int  # tokens of KV a sequence keeps (every layer windowed), 0: all of them
    dtype: str  # what the model runs in: the request's, or the device's default
    prefix_caching: bool
    piecewise_capture_sizes: tuple[int, ...] = ()  # token counts of the mixed graphs (none: off)
    piecewise_graph_bytes: int = 0  # of cudagraph_bytes, what the mixed graphs hold
    kv_cache_dtype: str = ""  # what the KV cache stores (the model's dtype, or float8_e4m3fn)
    quantization: str = ""  # "fp8" when the decoder's linears are FP8
    quantize_head: bool = False  # whether the head is FP8 too
    tensor_parallel_size: int = 1  # ranks, one process each (the byte counts above are rank 0's)
    stream_interval: int = 1  # tokens a stream sends at a time after its first


@dataclass
class StartedModel:
    engine: Engine
    sizing: ModelSizing
    tokenizer: object | None


class _Phases:
    """Times each phase and the steps inside it, logs them, emits them (and progress inside a phase) to the
    LoadModel stream, and traces them: a span per phase, a child span per step."""

    def __init__(self, name: str, emit: EmitFn):
        self.name = name
        self.emit = emit
        self.timings: list[tuple[str, float]] = []
        self._phase = ""
        self._steps: list[str] = []

    @contextmanager
    def phase(self, phase: str) -> Iterator[tuple[StartupPhase, trace.Span]]:
        event = StartupPhase(phase)
        self._phase, self._steps = phase, []
        start = time.perf_counter()
        with spans.tracer.start_as_current_span(phase) as span:
            yield event, span  # the phase fills in its detail and its span's attributes
        event.seconds = time.perf_counter() - start
        detail = "; ".join(filter(None, [event.detail, ", ".join(self._steps)]))
        log.info("%s: %s took %.2f s%s", self.name, phase, event.seconds, f" ({detail})" if detail else "")
        self.timings.append((phase, event.seconds))
        self.emit(event)

    @contextmanager
    def step(self, step: str) -> Iterator[None]:
        """One step of the current phase: a child span, and a progress event with its seconds once it ends."""
        start = time.perf_counter()
        with spans.tracer.start_as_current_span(step):
            yield
        seconds = time.perf_counter() - start
        self._steps.append(f"{step} {seconds:.2f} s")
        self.emit(StartupPhase(self._phase, seconds, f"{step} took {seconds:.2f} s", progress=True, step=step))

    def progress(self, phase: str, detail: str) -> None:
        self.emit(StartupPhase(phase, detail=detail, progress=True))


def start_model(target: LoadTarget, fetcher: BundleFetcher, step_observers: list[StepObserver], emit: EmitFn,
                deadline: float | None = None) -> StartedModel:
    """Run every startup phase and start the engine; raises a KilnError the client can act on. ``deadline``
    (time.monotonic(), the LoadModel's) bounds the calls to the compile service."""
    with spans.phase_span(spans.LOAD_MODEL, model=target.name, runtime_mode=target.engine_config.runtime_mode.value):
        try:
            return _start_model(target, fetcher, step_observers, emit, deadline)
        except KilnError:
            raise
        except Exception as exc:  # out of device memory or disk is the load's limit, not a Kiln bug
            caller = resource_error(exc, f"loading {target.name}")
            if caller is None:
                raise
            raise caller from exc


def _start_model(target: LoadTarget, fetcher: BundleFetcher, step_observers: list[StepObserver], emit: EmitFn,
                 deadline: float | None) -> StartedModel:
    phases = _Phases(target.name, emit)
    started = time.perf_counter()
    config = target.engine_config
    fetched: FetchedBundle | None = None
    with phases.phase(spans.FETCH) as (event, span):
        if config.runtime_mode == RuntimeMode.EAGER:
            event.detail = "eager: nothing to fetch"
        else:
            fetched = fetcher.fetch(target.spec, target.resolved, target.compile_config, target.key,
                                    lambda detail: phases.progress("fetch", detail), deadline, phases.step)
            event.detail = f"{fetched.source}, key {fetched.key}"
            span.set_attributes({spans.CACHE_KEY: fetched.key, spans.SOURCE: fetched.source})
    if fetched is not None and config.max_num_batched_tokens > fetched.max_compiled_tokens:
        raise InvalidArgument(f"max_num_batched_tokens: {config.max_num_batched_tokens} exceeds bundle "
                              f"{fetched.key[:12]}'s compiled token range [1, {fetched.max_compiled_tokens}]")
    ranks = None
    if config.tensor_parallel_size > 1:  # they build and load their shards while this process does its own
        ranks = StartingRanks.spawn(target.name, target.resolved, config, target.weights, target.weights_dir,
                                    target.weights_seed, fetched, fetcher.trusted)
    try:
        return _start_on_device(phases, target, fetcher, step_observers, emit, config, fetched, ranks, started)
    except BaseException as exc:
        if ranks is None:
            raise
        # A rank that died after the join fails rank 0's next collective (a capture, the KV agreement) with the
        # group's error; its exit says more.
        joined_then_failed = ranks.group is not None and isinstance(exc, Exception) and not isinstance(exc, KilnError)
        gone = ranks.group.exited() if joined_then_failed else None
        ranks.abandon()
        if gone is not None:
            raise Unavailable(f"model: {gone} while loading; its log says why") from exc
        raise


def _start_on_device(phases: "_Phases", target: LoadTarget, fetcher: BundleFetcher,
                     step_observers: list[StepObserver], emit: EmitFn, config: EngineConfig,
                     fetched: FetchedBundle | None, ranks: StartingRanks | None, started: float) -> StartedModel:
    """Every phase after the fetch, and the engine; with ``ranks``, rank 0's, the others joined at the end."""
    cudagraph = config.runtime_mode == RuntimeMode.CUDAGRAPH
    # One model at a time from here to the engine, per process: the memory profile measures the device's peak,
    # which a concurrent load would inflate. Fetches (a compile on the compile service, a download) still overlap,
    # and so do other models' steps: loading a bundle traces nothing (kiln.compilation.piecewise.SplitForward).
    with _DEVICE_PHASES:
        with phases.phase(spans.LOAD_WEIGHTS) as (event, span):
            with phases.step(spans.BUILD_MODEL):
                loaded = load_weights(target.resolved, config, target.weights, target.weights_seed)
            tokenizer = _load_tokenizer(target, phases.step)
            event.detail = f"{loaded.weights_bytes / 1e6:.1f} MB from {target.weights}"
            span.set_attributes({spans.BYTES: loaded.weights_bytes, spans.WEIGHTS: target.weights})

        kv_spec = kv_cache.KVCacheSpec.from_config(target.resolved.config, config.block_size,
                                                   kv_cache.cache_dtype(config.kv_cache_dtype, target.resolved.dtype),
                                                   config.tensor_parallel_size)
        with phases.phase(spans.PROFILE_MEMORY) as (event, span):
            with phases.step(spans.PROFILE_FORWARD):
                activation_peak = profile_memory(loaded.token_model, config)
            kv = None
            # With CUDA graphs, the cache is sized once they are captured and measured; over ranks, once the ranks
            # have joined (their NCCL buffers taken) and can agree.
            if not cudagraph and ranks is None:
                with phases.step(spans.KV_CACHE):
                    kv = kv_sizing.allocate_budgeted(config, loaded.weights_bytes, activation_peak, kv_spec,
                                                     loaded.kv_window)
                event.detail = _blocks_detail(kv, config)
                span.set_attributes({spans.NUM_KV_BLOCKS: kv.num_blocks, spans.KV_CACHE_BYTES: kv.bytes})
            span.set_attribute(spans.ACTIVATION_PEAK_BYTES, activation_peak)

        buffers = StepBuffers.for_config(config, target.resolved.config.vocab_size, kv_spec.num_kv_heads)
        # A few blocks for the warm-ups and the graphs' measure before the real cache exists.
        scratch_kv = kv.caches if kv else kv_cache.allocate(kv_spec, warm_up_blocks(config.block_size), config.device)
        scratch_scales = kv.scales if kv else kv_cache.allocate_scales(kv_spec, config.kv_cache_scale, config.device)
        forward = ModelForward(loaded.token_model)
        with phases.phase(spans.LOAD_COMPILED) as (event, span):
            if fetched is None:
                event.detail = "eager: the uncompiled model serves"
            else:
                with phases.step(spans.UNPICKLE):
                    forward = ModelForward(loaded.token_model,
                                           load_compiled(fetched.path, fetched.key, fetcher.trusted))
                with phases.step(spans.WARM_UP):
                    warm_up_compiled(forward, config, fetched.compile_sizes)
                with phases.step(spans.WARM_UP_ATTENTION):
                    warm_up_paged_attention(forward, scratch_kv, config.block_size, config.device, scratch_scales)
                event.detail = f"{fetched.path.name[:12]}, no Dynamo, no Inductor"
                span.set_attribute(spans.CACHE_KEY, fetched.key)
            if ranks is not None:
                with phases.step(spans.JOIN_RANKS):
                    forward = TensorParallelForward(forward, ranks.join(config.device))
                    if not cudagraph:  # every rank sizes its own budget: the cache gets the fewest blocks
                        kv = kv_sizing.allocate_budgeted(config, loaded.weights_bytes, activation_peak, kv_spec,
                                                         loaded.kv_window, agree=forward.agree_num_blocks)
                event.detail += f"; {ranks.size} ranks"
                if kv is not None:
                    event.detail += f", {_blocks_detail(kv, config)} (the fewest any rank holds)"

        full_graphs = mixed_graphs = None
        cudagraph_bytes = mixed_graph_bytes = 0
        with phases.phase(spans.CAPTURE_CUDAGRAPHS) as (event, span):
            if cudagraph:
                graphs = _capture(phases, span, forward, config, target, buffers, (scratch_kv, scratch_scales),
                                  loaded, activation_peak, kv_spec)
                full_graphs, mixed_graphs, kv = graphs.full, graphs.mixed, graphs.kv
                cudagraph_bytes, mixed_graph_bytes = graphs.captured_bytes, graphs.mixed_bytes
                del scratch_kv, scratch_scales
                event.detail = _blocks_detail(kv, config) + "; " + _graphs_detail(graphs)
            else:
                event.detail = f"skipped: runtime mode {config.runtime_mode}"

    prefix_root = block_hash.model_root(_model_identity(target, config, kv.kv_window, fetched)) \
        if config.enable_prefix_caching else None
    runner = ModelRunner(config, forward, kv, buffers, full_graphs, mixed_graphs)
    engine = Engine(target.name, runner, config, _eos_token_ids(target.resolved), step_observers, prefix_root)
    engine.start()
    total = time.perf_counter() - started
    emit(StartupPhase("ready", seconds=total, detail=f"{target.name} serves ({config.runtime_mode})"))
    total_memory = torch.cuda.mem_get_info()[1] if config.device == "cuda" else 0
    sizing = ModelSizing(
        key=fetched.key if fetched else "", num_kv_blocks=kv.num_blocks,
        block_size=config.block_size, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_bytes=kv.bytes,
        weights_bytes=loaded.weights_bytes, activation_peak_bytes=activation_peak, cudagraph_bytes=cudagraph_bytes,
        total_memory_bytes=total_memory, capture_sizes=config.capture_sizes,
        runtime_mode=config.runtime_mode, device=config.device, timings=tuple(phases.timings),
        vocab_size=target.resolved.config.vocab_size, kv_window=kv.kv_window, dtype=target.resolved.dtype_name,
        kv_cache_dtype=str(kv_spec.dtype).removeprefix("torch."), quantization=loaded.quantization,
        quantize_head=config.quantize_head,
        prefix_caching=config.enable_prefix_caching, piecewise_capture_sizes=config.piecewise_capture_sizes,
        piecewise_graph_bytes=mixed_graph_bytes,
        tensor_parallel_size=config.tensor_parallel_size, stream_interval=config.stream_interval)
    return StartedModel(engine, sizing, tokenizer)


def _model_identity(target: LoadTarget, config: EngineConfig, kv_window: int,
                    fetched: FetchedBundle | None) -> dict[str, str | int | float]:
    """What besides the tokens changes the keys and values a block holds: the prefix cache's root hash covers it.

    The bundle key covers the model config and dtype when there is a bundle; the hashes of the model spec and of the
    config cover the eager mode and whatever a spec or a config says of quantization. The block pool is the loaded
    model's own as well, so a model loaded again under the same name starts with an empty cache either way.
    """
    resolved = target.resolved
    return {
        "bundle_key": fetched.key if fetched else "",
        "model_spec": hashlib.sha256(target.spec.SerializeToString(deterministic=True)).hexdigest(),
        "model_config": hashlib.sha256(resolved.config.to_json_string(use_diff=False).encode()).hexdigest(),
        "dtype": resolved.dtype_name, "weights": target.weights, "weights_seed": target.weights_seed,
        "device": config.device, "runtime_mode": config.runtime_mode.value, "block_size": config.block_size,
        "kv_window": kv_window, "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
        "kv_cache_scale": config.kv_cache_scale,
    }


def _capture(phases: "_Phases", span: trace.Span, forward: ModelForward, config: EngineConfig, target: LoadTarget,
             buffers: StepBuffers, scratch: tuple[list, list | None], loaded: LoadedWeights, activation_peak: int,
             kv_spec: kv_cache.KVCacheSpec) -> CapturedGraphs:
    """The graphs and the KV cache sized around them (graph_capture.capture_graphs: every rank runs the same)."""
    def size_kv(graph_bytes: int) -> KVCache:
        return kv_sizing.allocate_budgeted(config, loaded.weights_bytes, activation_peak, kv_spec, loaded.kv_window,
                                           graph_bytes, forward.agree_num_blocks)

    def mixed_captured(size: int, done: int) -> None:
        total = len(config.piecewise_capture_sizes)
        phases.progress(spans.CAPTURE_CUDAGRAPHS, f"captured the mixed graph of {size} tokens ({done}/{total})")

    def captured(size: int, done: int) -> None:
        total = len(config.capture_sizes)
        phases.progress(spans.CAPTURE_CUDAGRAPHS, f"captured batch size {size} ({done}/{total})")
        span.add_event("captured", {spans.BATCH_SIZE: size})

    graphs = capture_graphs(forward, config, target.resolved, buffers, scratch, size_kv, phases.step,
                            mixed_captured, captured)
    span.set_attributes({spans.CAPTURE_SIZES: list(config.capture_sizes), spans.CAPTURE_SECONDS: graphs.seconds,
                         spans.PIECEWISE_CAPTURE_SIZES: list(config.piecewise_capture_sizes or ()),
                         spans.BYTES: graphs.captured_bytes, spans.NUM_KV_BLOCKS: graphs.kv.num_blocks,
                         spans.KV_CACHE_BYTES: graphs.kv.bytes})
    return graphs


def _blocks_detail(kv: KVCache, config: EngineConfig) -> str:
    detail = f"# {'GPU' if config.device == 'cuda' else 'CPU'} blocks: {kv.num_blocks}"
    if kv.kv_window:
        detail += f" (KV window {kv.kv_window} tokens: older blocks are freed as sequences run)"
    return detail


def _graphs_detail(graphs: CapturedGraphs) -> str:
    """vLLM's capture line, for both kinds of graph."""
    mixed = (f" ({len(graphs.mixed.graphs)} mixed graphs of up to {graphs.mixed.capture_sizes[-1]} tokens, "
             f"{graphs.mixed_bytes / (1 << 30):.2f} GiB)" if graphs.mixed else "")
    return (f"Graph capturing finished in {graphs.seconds:.0f} secs, took {graphs.captured_bytes / (1 << 30):.2f} "
            f"GiB{mixed}")


def _load_tokenizer(target: LoadTarget, step: StepFn):
    """The tokenizer of the model directory (or the weights directory), or None: then prompts are token ids."""
    candidates = [target.resolved.hf_dir, None if target.weights == "dummy" else Path(target.weights)]
    for directory in filter(None, candidates):
        if any((directory / name).is_file() for name in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            try:
                with step(spans.TOKENIZER):
                    tokenizer = AutoTokenizer.from_pretrained(directory)
            except (OSError, ValueError) as exc:
                raise InvalidArgument(f"weights: cannot load the tokenizer in {quote(str(directory))}: "
                                      f"{quote(str(exc))}") from None
            if getattr(tokenizer, "backend_tokenizer", None) is None:  # streamed text decodes with tokenizers
                raise InvalidArgument(f"weights: the tokenizer in {quote(str(directory))} has no fast (tokenizers) "
                                      f"backend; add its tokenizer.json")
            return tokenizer
    return None


def _eos_token_ids(resolved: ResolvedModel) -> frozenset[int]:
    eos = getattr(resolved.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
