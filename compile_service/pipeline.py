"""The compile pipeline: key -> (store hit | trace, split, Inductor per piece and size, save) -> bundle.

Identical requests serialize on the key's lock (a file lock, or a lease in Redis across compile services), so the
second one waits and gets a hit. Compiles of different keys run one at a time in the process: Dynamo's state is
global, and so are the environment variables that point Inductor and Triton at this process's cache partition
(``kiln.compiler_caches``).
"""

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compile_service.piecewise_backend import PiecewiseBackend
from kiln import bundle, cache_key
from kiln.artifact_store import ArtifactStore
from kiln.compile_config import CompileConfig
from kiln.compiler_caches import partitioned_caches
from kiln.errors import Internal, KilnError, first_line, resource_error
from kiln.model import build_model
from kiln.model_spec import ResolvedModel
from tracing import spans

log = logging.getLogger(__name__)

# (phase, piece, num_pieces, size)
ProgressFn = Callable[[str, int, int, str], None]

_compile_lock = threading.Lock()
TRACE_TOKENS = 16  # example token count Dynamo traces with; the dimension is marked dynamic


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
                  progress: ProgressFn = lambda *a: None) -> CompileOutcome:
    with spans.phase_span(spans.COMPILE, model=model.name) as span:
        outcome = _compile_or_hit(model, config, store, progress)
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
                    progress: ProgressFn) -> CompileOutcome:
    start = time.perf_counter()
    factors = cache_key.key_factors(model, config)
    key = cache_key.digest(factors)
    progress("key", 0, 0, "")
    with store.lock(key):
        path = store.get(key)
        if path is not None:
            log.info("compile %s: cache hit %s", model.name, key[:12])
            return _hit(key, factors, path, start)
        staged = None
        try:
            staged = store.staging_dir()
            # One compile at a time: Dynamo's state and the cache directories' environment variables are global.
            with _compile_lock, partitioned_caches():
                manifest = _compile_into(staged, key, factors, model, config, progress)
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


def _discard(store: ArtifactStore, staged) -> None:
    if staged is not None:
        store.discard(staged)


def _compile_into(staged, key, factors, model: ResolvedModel, config: CompileConfig,
                  progress: ProgressFn) -> bundle.Manifest:
    timings = {}
    t = time.perf_counter()
    module = build_model(model, config.device)
    timings["build"] = time.perf_counter() - t
    vocab = model.config.vocab_size

    def concrete_inputs(n: int):
        ids = torch.randint(0, vocab, (n,), device=config.device)
        return ids, torch.arange(n, device=config.device)

    backend = PiecewiseBackend(config.splitting_ops, config.compile_sizes, config.max_num_batched_tokens,
                               config.inductor_config_patches,
                               concrete_inputs, progress)
    ids, positions = concrete_inputs(min(TRACE_TOKENS, config.max_num_batched_tokens))
    for tensor in (ids, positions):
        torch._dynamo.mark_dynamic(tensor, 0, min=1, max=config.max_num_batched_tokens)
    progress("trace", 0, 0, "")
    t = time.perf_counter()
    trace_start_ns = time.time_ns()
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(
            module, fullgraph=True, backend=backend,
            options={"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe},
        ).forward.aot_compile(((ids, positions), {}))
    elapsed = time.perf_counter() - t
    # Dynamo's tracing ends where it hands the graph to the backend, whose split and Inductor are spans of their own.
    spans.record_phase(spans.TRACE, trace_start_ns, backend.stats.graph_received_ns)
    timings.update(backend.stats.timings)
    timings["trace"] = elapsed - sum(backend.stats.timings.values())
    progress("save", 0, 0, "")
    with spans.phase_span(spans.SAVE) as span:
        t = time.perf_counter()
        compiled.save_compiled_function(str(staged / bundle.COMPILED_FN))
        (staged / bundle.KEY_FACTORS).write_text(json.dumps(factors, indent=1, sort_keys=True, default=str))
        timings["save"] = time.perf_counter() - t
        manifest = bundle.write_manifest(
            staged, key=key, model=model.name, config_summary=f"{model.dtype_name} {config.summary()}",
            num_pieces=backend.stats.num_pieces, num_splits=backend.stats.num_splits,
            timings={k: round(v, 4) for k, v in timings.items()}, created_unix=time.time(),
        )
        span.set_attribute(spans.BYTES, manifest.total_bytes)
    return manifest
