"""The Inductor options a client may set: one reviewed allowlist, and the options refused on purpose, with why.

A client's ``inductor_config_patches_json`` reaches ``torch._inductor.config.patch`` in the compile service, and
some Inductor options name a compiler binary, a directory to write to, a module to import or a callable to run.
So only options that change the generated code and nothing else (tuning, fusion, layout, asserts, ...) are
accepted, each with the values it may take. Everything else that exists is PERMISSION_DENIED, naming the option;
a name Inductor does not know, or a value of the wrong kind, is INVALID_ARGUMENT. ``tests/test_inductor_options.py``
walks every option of the installed torch and fails when one that takes a string or a callable is in neither list.
"""

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

from kiln.errors import InvalidArgument, PermissionDenied, quote
from kiln.json_object import parse_json_object

FIELD = "config.inductor_config_patches_json"
# Patches are a handful of options; a longer text is not a patch set, and is refused before it is parsed.
MAX_PATCHES_JSON_BYTES = 64 << 10


@dataclass(frozen=True)
class Allowed:
    """The values one allowed option may take."""

    check: Callable[[object], bool]
    says: str  # the values, for the error message


def _bool() -> Allowed:
    return Allowed(lambda v: isinstance(v, bool), "true or false")


def _int(low: int, high: int, nullable: bool = False) -> Allowed:
    def check(v):
        return (nullable and v is None) or (isinstance(v, int) and not isinstance(v, bool) and low <= v <= high)

    return Allowed(check, f"an integer in [{low}, {high}]" + (" or null" if nullable else ""))


def _one_of(*choices) -> Allowed:
    """Exactly one of ``choices``, of its type too: 1.0 and true are not 1."""
    return Allowed(lambda v: any(type(v) is type(c) and v == c for c in choices),
                   "one of " + ", ".join(map(json.dumps, choices)))


def _backends(*choices: str) -> Allowed:
    def check(v):
        return isinstance(v, str) and bool(v) and all(part in choices for part in v.split(","))

    return Allowed(check, f"a comma-separated list of {', '.join(choices)}")


# Options that change code generation and nothing else. Bounds keep one request from asking for a compile that
# never ends (a fusion size of a billion).
ALLOWED: dict[str, Allowed] = {
    # autotuning and its search
    "max_autotune": _bool(),
    "max_autotune_pointwise": _bool(),
    "max_autotune_gemm": _bool(),
    "max_autotune_gemm_backends": _backends("ATEN", "TRITON", "CPP"),
    "max_autotune_gemm_search_space": _one_of("DEFAULT", "EXHAUSTIVE"),
    "max_autotune_conv_backends": _backends("ATEN", "TRITON"),
    "max_autotune_flex_search_space": _one_of("DEFAULT", "EXHAUSTIVE"),
    "coordinate_descent_tuning": _bool(),
    "coordinate_descent_check_all_directions": _bool(),
    "coordinate_descent_search_radius": _int(1, 8),
    "benchmark_fusion": _bool(),
    "benchmark_epilogue_fusion": _bool(),
    "max_epilogue_benchmarked_choices": _int(1, 16),
    # fusion and scheduling
    "epilogue_fusion": _bool(),
    "epilogue_fusion_first": _bool(),
    "aggressive_fusion": _bool(),
    "loop_ordering_after_fusion": _bool(),
    "max_fusion_size": _int(1, 1024),
    "max_pointwise_cat_inputs": _int(1, 128),
    "realize_reads_threshold": _int(1, 64),
    "score_fusion_memory_threshold": _int(1, 1024),
    "combo_kernels": _bool(),
    "reorder_for_locality": _bool(),
    "reorder_for_peak_memory": _bool(),
    "inplace_buffers": _bool(),
    "allow_buffer_reuse": _bool(),
    "memory_pool": _one_of("none", "intermediates", "outputs", "combined"),
    # graph passes
    "pattern_matcher": _bool(),
    "split_cat_fx_passes": _bool(),
    "group_fusion": _bool(),
    "batch_fusion": _bool(),
    "permute_fusion": _bool(),
    "efficient_conv_bn_eval_fx_passes": _bool(),
    "dce": _bool(),
    "split_reductions": _bool(),
    "unroll_reductions_threshold": _int(1, 64),
    "mixed_mm_choice": _one_of("default", "triton", "aten", "heuristic"),
    # layout and padding
    "layout_optimization": _bool(),
    "keep_output_stride": _bool(),
    "comprehensive_padding": _bool(),
    "pad_outputs": _bool(),
    "padding_alignment_bytes": _int(1, 4096),
    "shape_padding": _bool(),
    "triton_kernel_default_layout_constraint": _one_of("needs_fixed_stride_order", "flexible_layout"),
    # numerics and asserts
    "fallback_random": _bool(),
    "emulate_precision_casts": _bool(),
    "size_asserts": _bool(),
    "nan_asserts": _bool(),
    "scalar_asserts": _bool(),
    "alignment_asserts": _bool(),
    "use_fast_math": _bool(),
    # the Triton backend's code generation
    "triton.unique_kernel_names": _bool(),
    "triton.descriptive_names": _one_of("torch", "original_aten", "inductor_node"),
    "triton.max_tiles": _int(1, 3, nullable=True),
    "triton.prefer_nd_tiling": _bool(),
    "triton.autotune_pointwise": _bool(),
    "triton.autotune_cublasLt": _bool(),
    "triton.persistent_reductions": _bool(),
    "triton.cooperative_reductions": _bool(),
    "triton.divisible_by_16": _bool(),
    "triton.dense_indexing": _bool(),
    "triton.use_block_ptr": _bool(),
    "triton.multi_kernel": _one_of(0, 1, 2, 3),
    "triton.spill_threshold": _int(0, 1024),
    "triton.codegen_upcast_to_fp32": _bool(),
    "triton.enable_persistent_tma_matmul": _bool(),
    "triton.enable_pdl": _bool(),  # programmatic dependent launch on sm_90+ (kiln/programmatic_launch.py)
    "triton.tiling_prevents_pointwise_fusion": _bool(),
    "triton.tiling_prevents_reduction_fusion": _bool(),
    # the C++ backend's code generation (its compiler, flags and threads are the operator's)
    "cpp.simdlen": _int(1, 2048, nullable=True),
    "cpp.min_chunk_size": _int(1, 1 << 16),
    "cpp.max_horizontal_fusion_size": _int(1, 128),
    "cpp.fallback_scatter_reduce_sum": _bool(),
    "cpp.weight_prepack": _bool(),
    "cpp.enable_tiling_heuristics": _bool(),
    "cpp.enable_unsafe_math_opt_flag": _bool(),
    "cpp.enable_floating_point_contract_flag": _one_of("off", "on", "fast"),
    "cpp.descriptive_names": _one_of("torch", "original_aten", "inductor_node"),
}

PATH = "names a file or directory on the server"
BINARY = "names a compiler, its flags or a toolkit the server would run"
CODE = "names a module, pass, class or callable the server would import or call"
DEBUG = "writes debug, trace, profile or log output"
WORKERS = "sets a thread or process count, or how worker processes start"
TESTING = "is a testing hook (injected bugs, distorted benchmarks)"
BACKEND = "chooses a code generator the operator did not set up"
OPERATOR = "is the operator's setting (caches, timeouts, collectives, runtime behaviour)"
INTERNAL = "is internal to Inductor"

# Whole families, by prefix.
REFUSED_PREFIXES: dict[str, str] = {
    "_": INTERNAL,
    "trace.": DEBUG,
    "aot_inductor.": PATH,  # AOTInductor packaging: output paths, shim and custom-op libraries
    "test_configs.": TESTING,
    "cuda.": BINARY,  # nvcc, CUTLASS directories, arch flags
    "cutlass.": BINARY,
    "xpu.": BINARY,
    "rocm.": BINARY,
    "halide.": BACKEND,
    "aten_distributed_optimizations.": OPERATOR,  # collectives; takes profile paths and callables
    "lookup_table.": CODE,  # kernel choices by name from client data
    "autoheuristic_": DEBUG,  # collects heuristics data into a log path
    "bucket_": OPERATOR,  # collective bucketing: takes callables
}

# Single options, each refused for the reason given.
REFUSED: dict[str, str] = {
    "add_pre_grad_passes": CODE,
    "remove_pre_grad_passes": CODE,
    "pre_grad_custom_pass": CODE,
    "post_grad_custom_pre_pass": CODE,
    "post_grad_custom_post_pass": CODE,
    "joint_custom_pre_pass": CODE,
    "joint_custom_post_pass": CODE,
    "custom_partitioner_fn": CODE,
    "inductor_choices_class": CODE,
    "external_matmul": CODE,
    "reorder_for_compute_comm_overlap_passes": CODE,
    "pre_grad_fusion_options": CODE,
    "post_grad_fusion_options": CODE,
    "unsafe_marked_cacheable_functions": CODE,
    "estimate_op_runtime": CODE,
    "cudagraph_policy": CODE,
    "autotune_lookup_table": CODE,
    "disabled_passes": CODE,
    "max_autotune_conv_bwd_input_backends": OPERATOR,  # backward passes: Kiln compiles inference only
    "max_autotune_conv_bwd_weight_backends": OPERATOR,
    "custom_should_partition_ops": OPERATOR,
    "cudagraph_unsafe_unbacked_ops": OPERATOR,
    "pre_grad_pass_timing": OPERATOR,
    "layout_opt_default": OPERATOR,
    "cpp.cxx": BINARY,
    "cpp.march": BINARY,
    "cpp.gemm_cache_blocking": OPERATOR,
    "cpp.gemm_thread_factors": WORKERS,
    "cpp.threads": WORKERS,
    "cpp.dynamic_threads": WORKERS,
    "cpp.inject_log1p_bug_TESTING_ONLY": TESTING,
    "cpp.inject_relu_bug_TESTING_ONLY": TESTING,
    "triton.inject_relu_bug_TESTING_ONLY": TESTING,
    "cpp.enable_kernel_profile": DEBUG,
    "cpu_backend": BACKEND,
    "cuda_backend": BACKEND,
    "xpu_backend": BACKEND,
    "tpu_backend": BACKEND,
    "global_cache_dir": PATH,
    "torchinductor_worker_logpath": PATH,
    "worker_log_path": PATH,
    "profile_bandwidth_output": PATH,
    "triton.proton_output_dir": PATH,
    "profile_bandwidth": DEBUG,
    "profile_bandwidth_regex": DEBUG,
    "enabled_metric_tables": DEBUG,
    "fx_passes_numeric_check": DEBUG,
    "triton.debug_dump_kernel_inputs": DEBUG,
    "benchmark_kernel": DEBUG,
    "debug": DEBUG,
    "compile_threads": WORKERS,
    "worker_start_method": WORKERS,
    "autotune_in_subproc": WORKERS,
    "freezing": OPERATOR,  # bakes the weights into the code: one bundle would no longer serve every checkpoint
    "triton.cudagraphs": OPERATOR,  # Kiln captures CUDA graphs itself, after sizing the KV cache
    "force_disable_caches": OPERATOR,
    "fx_graph_cache": OPERATOR,
    "fx_graph_remote_cache": OPERATOR,
    "autotune_local_cache": OPERATOR,
    "autotune_remote_cache": OPERATOR,
    "bundled_autotune_remote_cache": OPERATOR,
}


def refusal_reason(name: str) -> str | None:
    """Why an existing option is refused on purpose, or None when it is neither refused nor allowed by name."""
    if name in REFUSED:
        return REFUSED[name]
    for prefix, reason in REFUSED_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


def parse_patches(text: str) -> dict:
    """The patches of a wire config, every option checked; the first refused one raises, naming it."""
    if len(text.encode()) > MAX_PATCHES_JSON_BYTES:
        raise InvalidArgument(f"{FIELD}: {len(text.encode())} bytes, more than {MAX_PATCHES_JSON_BYTES}")
    patches = parse_json_object(text, FIELD)
    for name, value in patches.items():
        check_option(name, value)
    return patches


@functools.cache
def inductor_option_names() -> frozenset[str]:
    """Every option of the installed torch's Inductor config, nested ones dotted (``triton.max_tiles``); those that
    ``get_config_copy`` leaves out (``force_disable_caches``, ...) too, so that they are refused as not the client's
    (PERMISSION_DENIED), not as unknown."""
    from torch._inductor import config as inductor_config

    return frozenset(inductor_config.get_config_copy()) | frozenset(getattr(inductor_config, "_config", {}))


def check_option(name: str, value: object) -> None:
    if name not in inductor_option_names():
        raise InvalidArgument(f"{FIELD}: {quote(name)} is not an Inductor config option")
    allowed = ALLOWED.get(name)
    if allowed is not None:
        if not allowed.check(value):
            raise InvalidArgument(f"{FIELD}: {name} is {quote(value)}; it takes {allowed.says}")
        return
    reason = refusal_reason(name) or "is not on Kiln's allowlist of code-generation options"
    raise PermissionDenied(f"{FIELD}: {name} {reason}; a client may not set it "
                           "(allowed: see kiln/compilation/inductor_options.py)")
