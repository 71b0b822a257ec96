"""The compile pipeline: key -> (store hit | trace, split, Inductor per piece and size, save) -> bundle.

Identical requests serialize on the key's lock (a file lock, or a lease in Redis across compile services), so the
second one waits and gets a hit. Compiles of different keys run one at a time in the process: Dynamo's state is
global, and so are the environment variables that point Inductor and Triton at this process's cache partition
(``kiln.compilation.compiler_caches``).
"""

import contextvars
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from compile_service.piecewise_backend import PiecewiseBackend
from kiln.compilation import cache_key
from kiln.compilation.compiler_caches import partitioned_caches
from kiln.compilation.config import CompileConfig
from kiln.errors import Internal, KilnError, first_line, resource_error
from kiln.model.causal_lm import TokenModel, build_model
from kiln.model.layer_regions import LayerStep
from kiln.model.spec import ResolvedModel
from kiln.model.tensor_parallel import TensorParallel
from kiln.store import bundle
from kiln.store.artifact_store import ArtifactStore
from tracing import spans

log = logging.getLogger(__name__)

# (phase, piece, num_pieces, size, region)
ProgressFn = Callable[[str, int, int, str, str], None]

# Every compile runs on this one thread, in turn: Dynamo's state and the cache directories' environment variables
# are global, and a thread that has run Dynamo and Inductor must not exit while the process goes on. The exit of a
# thread that had just compiled Llama-3-8B crashed the compile service about one compile in three on the H200
# (SIGSEGV in the event loop's thread, in whatever Python ran next; issue 23); the executor's thread never exits.
_compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")
# Example token count Dynamo traces with on CUDA (the dimension is marked dynamic), at most the compile's largest
# step. Inductor sizes the blocks of a symbolic piece's Triton kernels for it. Traced at 16 tokens, RoPE's kernel
# over q had the configs 512 and 256 elements a program of 4 warps (4 and 2 bf16 values a thread: 64- and 32-bit
# loads), k's 256 and 128 (2 and 1), and they took 21.4 and 11.4 µs of a 2,048-token FP8 layer on an H100 (1.6 and
# 0.7 TB/s; BENCHMARKS.md); traced at 2,048, both have 1,024 a program of 4 warps (8 a thread, 128-bit loads) among
# theirs. The eager forward that records the example runs the reference attention (a score matrix per head): hence
# the bound. The CPU's C++ kernels take no block size from it, and a CPU compile traced at 16 tokens is faster (CI: 13%
# off its compile tests).
TRACE_TOKENS = 2048
CPU_TRACE_TOKENS = 16


@dataclass
class CompileOutcome:
    key: str
    cache_hit: bool
    bundle_bytes: int
    num_pieces: int
    num_splits: int
    factors: dict
    timings: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0


def compile_model(model: ResolvedModel, config: CompileConfig, store: ArtifactStore,
                  progress: ProgressFn = lambda *a: None, deadline: float | None = None) -> CompileOutcome:
    """The bundle of ``model`` under ``config``, compiled unless the store has it; waiting for the key's lock ends
    at ``deadline`` (the call's), so a worker thread never waits on behalf of a client that gave up."""
    with spans.phase_span(spans.COMPILE, model=model.name) as span:
        outcome = _compile_or_hit(model, config, store, progress, deadline)
        span.set_attributes({spans.CACHE_KEY: outcome.key, spans.CACHE_HIT: outcome.cache_hit,
                             spans.NUM_PIECES: outcome.num_pieces, spans.BYTES: outcome.bundle_bytes})
        return outcome


def look_up(model: ResolvedModel, config: CompileConfig, store: ArtifactStore) -> CompileOutcome:
    """The key and whether the store has its bundle, compiling nothing."""
    start = time.perf_counter()
    factors = cache_key.key_factors(model, config)
    key = cache_key.digest(factors)
    path = store.get(key)
    if path is None:
        return CompileOutcome(key, False, 0, 0, 0, factors, total_s=time.perf_counter() - start)
    return _hit(key, factors, path, start)


def _hit(key: str, factors: dict, path, start: float) -> CompileOutcome:
    manifest = bundle.read_manifest(path)
    return CompileOutcome(key, True, manifest.total_bytes, manifest.num_pieces, manifest.num_splits, factors,
                          manifest.timings, time.perf_counter() - start)


def _compile_or_hit(model: ResolvedModel, config: CompileConfig, store: ArtifactStore,
                    progress: ProgressFn, deadline: float | None) -> CompileOutcome:
    start = time.perf_counter()
    factors = cache_key.key_factors(model, config)
    key = cache_key.digest(factors)
    key_s = time.perf_counter() - start
    progress("key", 0, 0, "", "")
    with store.lock(key, deadline):
        path = store.get(key)
        if path is not None:
            log.info("compile %s: cache hit %s", model.name, key[:12])
            return _hit(key, factors, path, start)
        staged = None
        try:
            staged = store.staging_dir()
            manifest = _on_compile_thread(config.device, _compile_into, staged, key, factors, model, config, progress,
                                          key_s)
            store.commit(key, staged)
        except KilnError:  # the store's own refusal (unreachable, lease lost): its status, not INTERNAL
            _discard(store, staged)
            raise
        except Exception as exc:
            _discard(store, staged)
            caller = resource_error(exc, f"compile of {model.name}")
            if caller is not None:
                log.warning("compile %s failed: %s", model.name, caller)
                raise caller from exc
            log.exception("compile %s failed", model.name)
            raise Internal(f"compile failed inside torch: {first_line(exc)}") from exc
    total = time.perf_counter() - start
    log.info("compile %s: %d pieces in %.2fs, key %s", model.name, manifest.num_pieces, total, key[:12])
    return CompileOutcome(key, False, manifest.total_bytes, manifest.num_pieces, manifest.num_splits, factors,
                          manifest.timings, total)


def _on_compile_thread(device: str, fn: Callable, *args):
    """``fn(*args)`` on the compile thread with the compiler caches partitioned for ``device``, in this thread's
    context (so its spans are children of this one's); this thread waits for it."""
    def partitioned():
        with partitioned_caches(device):
            return fn(*args)

    return _compiler.submit(contextvars.copy_context().run, partitioned).result()


def _discard(store: ArtifactStore, staged) -> None:
    if staged is not None:
        store.discard(staged)


def _compile_into(staged, key, factors, model: ResolvedModel, config: CompileConfig,
                  progress: ProgressFn, key_s: float) -> bundle.Manifest:
    """The bundle in ``staged``, its timings a cold compile phase by phase: the key (a meta-device build of the
    model; on CPU, Inductor's ISA probes), the model's build, the eager forward that finds each layer kind's inputs,
    then trace, split, Inductor and save."""
    timings = {"key": key_s, "trace": 0.0, "split": 0.0, "inductor": 0.0}
    t = time.perf_counter()
    module = build_model(model, config.device, quantization=config.quantization,
                         tensor_parallel=TensorParallel(0, config.tensor_parallel_size))
    timings["build"] = time.perf_counter() - t
    compiled, num_pieces, num_splits = [], 0, 0
    torch._dynamo.reset()
    t = time.perf_counter()
    examples = _layer_examples(module, model, config)
    timings["examples"] = time.perf_counter() - t
    for kind, (step, inputs) in enumerate(examples):
        code, stats = _compile_layer(f"layer{kind}", step, inputs, config, progress, num_pieces)
        compiled.append(code)
        for phase in ("trace", "split", "inductor"):
            timings[phase] += stats.timings[phase]
        num_pieces += stats.num_pieces
        num_splits += stats.num_splits
    progress("save", 0, 0, "", "")
    with spans.phase_span(spans.SAVE) as span:
        t = time.perf_counter()
        for kind, code in enumerate(compiled):
            code.save_compiled_function(str(staged / bundle.compiled_layer_file(kind)))
        (staged / bundle.LAYER_KINDS).write_text(json.dumps(list(module.layers.kinds)))
        (staged / bundle.KEY_FACTORS).write_text(json.dumps(factors, indent=1, sort_keys=True, default=str))
        timings["save"] = time.perf_counter() - t
        manifest = bundle.write_manifest(
            staged, key=key, model=model.name, config_summary=f"{model.dtype_name} {config.summary()}",
            num_pieces=num_pieces, num_splits=num_splits,
            timings={k: round(v, 4) for k, v in timings.items()}, created_unix=time.time(),
        )
        span.set_attribute(spans.BYTES, manifest.total_bytes)
    del module, examples, compiled
    if config.device == "cuda":  # the dummy weights' memory back to the device: an execute service on the same GPU
        torch.cuda.empty_cache()  # loads next (a 70B in FP8 fits one H200 once, not twice)
    return manifest


@torch.no_grad()
def _layer_examples(module: TokenModel, model: ResolvedModel, config: CompileConfig) -> list[tuple]:
    """The first layer of each kind with the inputs it receives in an eager forward, the token dimension of each
    marked dynamic over [1, max tokens]."""
    tokens = min(CPU_TRACE_TOKENS if config.device == "cpu" else TRACE_TOKENS, config.max_compiled_tokens)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=config.device)
    seen: dict[int, tuple] = {}

    def record(step: LayerStep, hidden, cos, sin, index):
        seen.setdefault(step.kind, (step, (hidden.clone(), cos.clone(), sin.clone())))
        return step(hidden, cos, sin, index)

    with module.layers.running([record] * module.layers.num_kinds):
        module(ids, torch.arange(tokens, device=config.device))
    examples = []
    for kind in range(module.layers.num_kinds):
        step, token_inputs = seen[kind]
        for tensor in token_inputs:  # [1, T, ...]
            torch._dynamo.mark_dynamic(tensor, 1, min=1, max=config.max_compiled_tokens)
        examples.append((step, (*token_inputs, step.index)))
    return examples


def _compile_layer(region: str, step: LayerStep, inputs: tuple, config: CompileConfig, progress: ProgressFn,
                   first_piece: int):
    """Dynamo once over one layer, then the piecewise backend: the layer's aot-compiled function and the backend's
    stats. The code serves every layer of its kind, so it must not depend on the one it was traced on: a guard on
    the layer index (which the attention op takes as an input instead) refuses the compile."""
    backend = PiecewiseBackend(region, config.splitting_ops, config.compile_sizes, config.max_compiled_tokens,
                               config.inductor_config_patches, progress, first_piece)
    index_guards = []

    def keep_tensor_guards(entries):
        index_guards.extend(e.name for e in entries if ".layer_idx" in e.name)
        return torch.compiler.keep_tensor_guards_unsafe(entries)

    progress("trace", 0, 0, "", region)
    t = time.perf_counter()
    trace_start_ns = time.time_ns()
    with torch.no_grad(), torch._dynamo.config.patch(enable_aot_compile=True):
        code = torch.compile(step, fullgraph=True, backend=backend,
                             options={"guard_filter_fn": keep_tensor_guards}).forward.aot_compile((inputs, {}))
    if index_guards:
        raise RuntimeError(f"the traced layer's code depends on its index ({index_guards[0]}); it cannot serve the "
                           f"other layers of its kind")
    # Dynamo's tracing ends where it hands the graph to the backend, whose split and Inductor are spans of their own.
    spans.record_phase(spans.TRACE, trace_start_ns, backend.stats.graph_received_ns, region=region)
    backend.stats.timings["trace"] = time.perf_counter() - t - sum(backend.stats.timings.values())
    return code, backend.stats
