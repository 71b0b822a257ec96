"""Bringing one model up, phase by phase: fetch, load weights, profile memory, load compiled, capture CUDA graphs.

Each phase is timed, logged, reported to the LoadModel stream as it ends, and a span under ``load_model`` with what
it measured. The order is the contract: the memory profile runs on the eager model before the compiled function is
loaded.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.engine_loop import Engine, StepObserver
from exec_service.engine.model_runner import ModelRunner
from exec_service.startup import kv_sizing
from exec_service.startup.fetch import BundleFetcher, FetchedBundle, StepFn
from exec_service.startup.memory_profile import profile_memory
from kiln.compilation.config import CompileConfig
from kiln.errors import InvalidArgument, KilnError, quote, resource_error
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
    cudagraph_bytes: int  # reserved for (CUDA) or taken by CUDA graphs
    total_memory_bytes: int  # 0 on CPU
    capture_sizes: tuple[int, ...]
    runtime_mode: RuntimeMode
    device: str
    timings: tuple[tuple[str, float], ...]  # every phase with its seconds
    vocab_size: int
    kv_window: int  # tokens of KV a sequence keeps (every layer windowed), 0: all of them
    dtype: str  # what the model runs in: the request's, or the device's default


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
    compiled_range = fetched.max_num_batched_tokens if fetched else target.compile_config.max_num_batched_tokens
    config = config.within_token_range(compiled_range)
    runner = ModelRunner(target.resolved, config)

    # One model at a time from here to the engine, per process: the memory profile measures the device's peak,
    # which a concurrent load would inflate. Fetches (a compile on the compile service, a download) still overlap,
    # and so do other models' steps: loading a bundle traces nothing (kiln.compilation.piecewise.SplitForward).
    with _DEVICE_PHASES:
        with phases.phase(spans.LOAD_WEIGHTS) as (event, span):
            with phases.step(spans.BUILD_MODEL):
                runner.load_weights(target.weights, target.weights_seed)
            tokenizer = _load_tokenizer(target, phases.step)
            event.detail = f"{runner.weights_bytes / 1e6:.1f} MB from {target.weights}"
            span.set_attributes({spans.BYTES: runner.weights_bytes, spans.WEIGHTS: target.weights})

        with phases.phase(spans.PROFILE_MEMORY) as (event, span):
            with phases.step(spans.PROFILE_FORWARD):
                activation_peak = profile_memory(runner.token_model, config)
            with phases.step(spans.KV_CACHE):
                budget = kv_sizing.memory_budget(config, runner.weights_bytes, activation_peak)
                kv_spec = runner.kv_cache_spec
                runner.allocate_kv_cache(kv_sizing.num_blocks(budget, kv_spec, config.max_model_len))
            event.detail = f"# {'GPU' if config.device == 'cuda' else 'CPU'} blocks: {runner.num_blocks}"
            if runner.kv_window:
                event.detail += f" (KV window {runner.kv_window} tokens: older blocks are freed as sequences run)"
            span.set_attributes({spans.ACTIVATION_PEAK_BYTES: activation_peak, spans.NUM_KV_BLOCKS: runner.num_blocks,
                                 spans.KV_CACHE_BYTES: runner.kv_cache_bytes})

        with phases.phase(spans.LOAD_COMPILED) as (event, span):
            if fetched is None:
                event.detail = "eager: the uncompiled model serves"
            else:
                with phases.step(spans.UNPICKLE):
                    runner.load_compiled(fetched.path, fetched.key, fetcher.trusted)
                with phases.step(spans.WARM_UP):
                    runner.warm_up_compiled()
                with phases.step(spans.WARM_UP_ATTENTION):
                    runner.warm_up_paged_attention()
                event.detail = f"{fetched.path.name[:12]}, no Dynamo, no Inductor"
                span.set_attribute(spans.CACHE_KEY, fetched.key)

        cudagraph_bytes = budget.cudagraph_reserve_bytes
        with phases.phase(spans.CAPTURE_CUDAGRAPHS) as (event, span):
            if config.runtime_mode == RuntimeMode.CUDAGRAPH:
                def captured(size: int, done: int) -> None:
                    total = len(config.capture_sizes)
                    phases.progress(spans.CAPTURE_CUDAGRAPHS, f"captured batch size {size} ({done}/{total})")
                    span.add_event("captured", {spans.BATCH_SIZE: size})

                seconds = runner.capture_cudagraphs(captured)
                cudagraph_bytes = runner.cudagraphs.captured_bytes
                event.detail = (f"Graph capturing finished in {seconds:.0f} secs, took "
                                f"{cudagraph_bytes / (1 << 30):.2f} GiB")
                span.set_attributes({spans.CAPTURE_SIZES: list(config.capture_sizes), spans.CAPTURE_SECONDS: seconds,
                                     spans.BYTES: cudagraph_bytes})
            else:
                event.detail = f"skipped: runtime mode {config.runtime_mode}"

    engine = Engine(target.name, runner, config, _eos_token_ids(target.resolved), step_observers)
    engine.start()
    total = time.perf_counter() - started
    emit(StartupPhase("ready", seconds=total, detail=f"{target.name} serves ({config.runtime_mode})"))
    sizing = ModelSizing(
        key=fetched.key if fetched else "", num_kv_blocks=runner.num_blocks,
        block_size=config.block_size, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_bytes=runner.kv_cache_bytes,
        weights_bytes=runner.weights_bytes, activation_peak_bytes=activation_peak, cudagraph_bytes=cudagraph_bytes,
        total_memory_bytes=budget.total_bytes, capture_sizes=config.capture_sizes,
        runtime_mode=config.runtime_mode, device=config.device, timings=tuple(phases.timings),
        vocab_size=target.resolved.config.vocab_size, kv_window=runner.kv_window, dtype=target.resolved.dtype_name)
    return StartedModel(engine, sizing, tokenizer)


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
