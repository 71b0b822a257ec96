"""Span names and attribute keys, in one place so both services and Jaeger queries agree; and ``phase_span``."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

log = logging.getLogger(__name__)
tracer = trace.get_tracer("kiln")

# Compile phases.
COMPILE = "compile"
TRACE = "trace"
SPLIT = "split"
INDUCTOR = "inductor"
SAVE = "save"
# Execute startup: LOAD_MODEL is the parent of the phases below it.
LOAD_MODEL = "load_model"
FETCH = "fetch"
LOAD_WEIGHTS = "load_weights"
PROFILE_MEMORY = "profile_memory"
LOAD_COMPILED = "load_compiled"
CAPTURE_CUDAGRAPHS = "capture_cudagraphs"
# Steps inside those phases, each a child span of its phase.
BUNDLE_KEY = "bundle_key"  # fetch: the key of the request's model and config (when it names none)
VERIFY = "verify"  # fetch: the manifest's signature and every file's sha256
CHECK_FACTORS = "check_factors"  # fetch: the bundle's key factors against this process and the request
BUILD_MODEL = "build_model"  # load_weights: the module and its weights on the device
TOKENIZER = "tokenizer"  # load_weights: the model directory's tokenizer, where it has one
PROFILE_FORWARD = "profile_forward"  # profile_memory: the eager forward whose peak is measured
KV_CACHE = "kv_cache"  # profile_memory (capture_cudagraphs with CUDA graphs): sizing and allocating the KV cache
MIXED_GRAPHS = "mixed_graphs"  # capture_cudagraphs: whole prefill / mixed steps at every piecewise_capture_sizes count
FULL_GRAPHS = "full_graphs"  # capture_cudagraphs: whole decode steps at every decode batch size
UNPICKLE = "unpickle"  # load_compiled: the compiled function out of the bundle
WARM_UP = "warm_up"  # load_compiled: the compiled function's first calls, smallest and largest step
WARM_UP_ATTENTION = "warm_up_attention"  # load_compiled: a prefill and a decode through the paged KV cache
JOIN_RANKS = "join_ranks"  # load_compiled: the other ranks of a tensor-parallel model ready, in one group
# Serving.
FORWARD = "forward"
FORWARD_STATS = "forward_stats"

# Kiln's own attributes. phase_span(..., piece=3) sets PIECE: keyword names are these keys without "kiln.".
MODEL = "kiln.model"
CACHE_KEY = "kiln.cache_key"
CACHE_HIT = "kiln.cache_hit"
NUM_PIECES = "kiln.num_pieces"
NUM_SPLITS = "kiln.num_splits"
MERGED_LINEARS = "kiln.merged_linears"  # a region's linear calls made one with an identical one (merged projections)
ROUTED_QUANTIZES = "kiln.routed_quantizes"  # a region's activation quantizes given Kiln's kernels (norms' too)
FUSED_RESIDUAL_ADDS = "kiln.fused_residual_adds"  # a region's residual adds taken into its FP8 product
ROUTED_ROTARIES = "kiln.routed_rotaries"  # a region's q/k rotations taken into the attention op's KV write
PIECE = "kiln.piece"
COMPILE_SIZE = "kiln.compile_size"  # a token count, or "symbolic"
REGION = "kiln.region"  # the compiled region: layer0, layer1, ... (one per kind of decoder layer)
BYTES = "kiln.bytes"
BATCH_SIZE = "kiln.batch_size"  # sequences in the step
NUM_TOKENS = "kiln.num_tokens"
PADDED_SIZE = "kiln.padded_size"  # tokens the compiled code or CUDA graph ran, padding included
RUNTIME_MODE = "kiln.runtime_mode"  # what LoadModel asked for: eager / compiled / cudagraph
PATH = "kiln.path"  # how the step ran: full_graph / mixed_graph / compiled / eager
PHASE = "kiln.phase"  # prefill / decode / mixed
HOST_WAIT_MS = "kiln.host_wait_ms"  # the device's wait for the host before the step (absent: it waited for work)
STATS_BATCH_SIZES = "kiln.stats.batch_sizes"
STATS_COUNTS = "kiln.stats.counts"
STATS_MEDIAN_MS = "kiln.stats.median_ms"
STATS_P90_MS = "kiln.stats.p90_ms"
STATS_P99_MS = "kiln.stats.p99_ms"
STATS_RUNTIME_MODES = "kiln.stats.runtime_modes"
STATS_PHASES = "kiln.stats.phases"
STATS_PATHS = "kiln.stats.paths"
SOURCE = "kiln.source"  # where fetch found the bundle: local cache, shared store <location>, downloaded
WEIGHTS = "kiln.weights"  # dummy, or the safetensors directory
ACTIVATION_PEAK_BYTES = "kiln.activation_peak_bytes"
NUM_KV_BLOCKS = "kiln.num_kv_blocks"
KV_CACHE_BYTES = "kiln.kv_cache_bytes"
CAPTURE_SIZES = "kiln.capture_sizes"
CAPTURE_SECONDS = "kiln.capture_seconds"
PIECEWISE_CAPTURE_SIZES = "kiln.piecewise_capture_sizes"
# Request spans: the Usage a Generate's last message carries, and one PREEMPTION event per preemption.
TIME_TO_FIRST_TOKEN_S = "kiln.time_to_first_token_s"
QUEUE_S = "kiln.queue_s"  # arrival to first scheduled
NUM_PREEMPTIONS = "kiln.num_preemptions"
PREEMPTION = "kiln.preemption"
RECOMPUTED_TOKENS = "kiln.recomputed_tokens"  # tokens whose KV a preemption dropped
CANCELLED = "kiln.cancelled"  # the client went away before the last token

# OpenTelemetry GenAI semantic conventions, for request spans. A Generate takes a raw prompt (no chat template), so
# its operation is text_completion and its span is named "text_completion {model}", as the conventions name spans.
TEXT_COMPLETION = "text_completion"
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens from the prefix cache
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"


def kiln_attributes(**attributes) -> dict:
    return {f"kiln.{name}": value for name, value in attributes.items()}


@contextmanager
def phase_span(name: str, **attributes) -> Iterator[trace.Span]:
    """A span for one phase, child of the current one, and the log line "<phase> took X s" that says the same.

    Yields the span so that what is only known at the end (bytes written, cache hit) can be added.
    """
    start = time.perf_counter()
    with tracer.start_as_current_span(name, attributes=kiln_attributes(**attributes)) as span:
        yield span
    detail = " ".join(f"{k}={v}" for k, v in attributes.items())
    log.info("%s took %.2f s%s", name, time.perf_counter() - start, f" ({detail})" if detail else "")


def record_phase(name: str, start_ns: int, end_ns: int, **attributes) -> None:
    """A phase measured by someone else's clock (wall-clock ns), as a child of the current span."""
    tracer.start_span(name, attributes=kiln_attributes(**attributes), start_time=start_ns).end(end_time=end_ns)
    log.info("%s took %.2f s", name, (end_ns - start_ns) / 1e9)
