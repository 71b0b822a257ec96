"""A LoadModelRequest checked at the edge: what to load and the engine's limits, every error naming its field. Each
number's own range was checked before the handler ran (kiln/rpc/field_bounds.py); here what depends on the model,
the bundle or the other fields."""

import dataclasses
import re

import torch
import torch.distributed

from exec_service.api.runtime_modes import runtime_mode_from_proto
from exec_service.engine.engine_config import DEFAULT_PIECEWISE_CAPTURE_SIZES, EngineConfig
from exec_service.engine.kv.kv_cache import KV_CACHE_DTYPES
from exec_service.startup.load_model import LoadTarget
from kiln.compilation.config import MIN_COMPILED_TOKENS, CompileConfig
from kiln.errors import FailedPrecondition, InvalidArgument, NotFound, quote
from kiln.model.hub import is_hub_id
from kiln.model.roots import ModelRoots
from kiln.model.spec import ResolvedModel, resolve
from kiln.model.tensor_parallel import check_shardable
from kiln.quantization.model_quantization import check_head, fp8_unsupported, quantization_of
from kiln.runtime_mode import RuntimeMode
from protos import exec_pb2

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_CACHE_BYTES = 64 << 20
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_WAITING = 256
MAX_BLOCK_SIZE = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def load_target(request: exec_pb2.LoadModelRequest, roots: ModelRoots) -> LoadTarget:
    """Validated, with every client-named directory (model, weights) checked against ``roots``."""
    if (request.tensor_parallel_size or 1) > 1 and request.config.device == "cuda":
        _check_gpus(request.tensor_parallel_size)  # before config.device's own check, which says less of this
    compile_config = tensor_parallel_config(request, CompileConfig.from_proto(request.config))
    resolved = resolve(request.model, compile_config.device, roots)
    check_shardable(resolved.config, compile_config.tensor_parallel_size)
    check_head(quantization_of(resolved.config, compile_config.quantization), request.quantize_head)
    weights, pinned = request.weights or "dummy", None
    if weights != "dummy":
        # org/name[@revision]: its snapshot in the server's Hugging Face cache
        pinned = roots.hub_dir(weights, "weights") if is_hub_id(weights) else roots.check_dir(weights, "weights")
        if not pinned.is_dir:
            raise NotFound(f"weights: {quote(weights)} is neither 'dummy' nor a directory with *.safetensors")
        weights = str(pinned.view)  # the files the check opened, never what the path names later
    return LoadTarget(
        name=model_name(request, resolved), spec=request.model, resolved=resolved, compile_config=compile_config,
        key=request.key.digest or None, engine_config=engine_config(request, resolved, compile_config),
        weights=weights, weights_seed=request.weights_seed, weights_dir=pinned)


def tensor_parallel_config(request: exec_pb2.LoadModelRequest, compile_config: CompileConfig) -> CompileConfig:
    """The compile config for the request's ranks: tensor_parallel_size, checked, is the bundle's too."""
    size = request.tensor_parallel_size or 1
    if request.config.tensor_parallel_size and compile_config.tensor_parallel_size != size:
        raise InvalidArgument(f"config.tensor_parallel_size: {compile_config.tensor_parallel_size} differs from "
                              f"tensor_parallel_size {size}; set only tensor_parallel_size")
    if size == 1:
        return compile_config
    if compile_config.device == "cuda":  # the default device, when config.device names none
        _check_gpus(size)
    if compile_config.quantization:
        raise InvalidArgument(f"tensor_parallel_size: {size} ranks do not serve quantization "
                              f"{compile_config.quantization!r} yet")
    return dataclasses.replace(compile_config, tensor_parallel_size=size)


def _check_gpus(size: int) -> None:
    """One GPU per rank, through NCCL: a host with fewer GPUs (or none visible) cannot serve ``size`` ranks."""
    gpus = torch.cuda.device_count()
    if size > gpus:
        raise FailedPrecondition(f"tensor_parallel_size: {size} ranks need {size} GPUs, one each; this host has "
                                 f"{gpus} (torch.cuda.device_count()); lower tensor_parallel_size")
    if not torch.distributed.is_nccl_available():
        raise FailedPrecondition(f"tensor_parallel_size: {size} ranks on cuda need NCCL, which this PyTorch build "
                                 f"lacks")


def engine_config(request: exec_pb2.LoadModelRequest, resolved: ResolvedModel,
                  compile_config: CompileConfig) -> EngineConfig:
    """Complete: every default filled in, the step budget checked against the compiled range it will run in."""
    device = compile_config.device
    mode = runtime_mode_from_proto(request.runtime_mode, device)
    if mode == RuntimeMode.CUDAGRAPH and device != "cuda":
        raise InvalidArgument("runtime_mode: cudagraph needs CUDA; this model runs on cpu")
    positions = getattr(resolved.config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
    max_model_len = request.max_model_len or min(positions, DEFAULT_MAX_MODEL_LEN)
    if not 2 <= max_model_len <= positions:
        raise InvalidArgument(f"max_model_len: {max_model_len} is outside [2, {positions}] (the model's "
                              f"max_position_embeddings)")
    max_num_seqs = request.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    compiled = compile_config.max_compiled_tokens
    max_num_batched_tokens = request.max_num_batched_tokens or compiled
    if not MIN_COMPILED_TOKENS <= max_num_batched_tokens <= compiled:
        raise InvalidArgument(f"max_num_batched_tokens: {max_num_batched_tokens} is outside [{MIN_COMPILED_TOKENS}, "
                              f"{compiled}] (the compiled token range, config.max_compiled_tokens)")
    utilization = request.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_bytes = request.kv_cache_bytes or (DEFAULT_CPU_KV_CACHE_BYTES if device == "cpu" else 0)
    block_size = request.block_size or DEFAULT_BLOCK_SIZE
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise InvalidArgument(f"block_size: {block_size} is not a power of two in [1, {MAX_BLOCK_SIZE}]")
    if request.capture_sizes and mode != RuntimeMode.CUDAGRAPH:
        raise InvalidArgument(f"capture_sizes: given, but runtime_mode is {mode}")
    largest_batch = min(max_num_seqs, max_num_batched_tokens)  # a decode step holds one token per sequence
    for size in request.capture_sizes:
        if not 1 <= size <= largest_batch:
            raise InvalidArgument(f"capture_sizes: {size} is outside [1, {largest_batch}] (max_num_seqs "
                                  f"{max_num_seqs}, max_num_batched_tokens {max_num_batched_tokens})")
    capture_sizes = ()
    if mode == RuntimeMode.CUDAGRAPH:
        capture_sizes = tuple(sorted(set(request.capture_sizes))) or default_capture_sizes(largest_batch)
    piecewise = piecewise_capture_sizes(request, mode, max_num_batched_tokens)
    max_num_waiting = request.max_num_waiting or DEFAULT_MAX_NUM_WAITING
    kv_cache_dtype, kv_cache_scale = _kv_cache_dtype(request, device)
    tensor_parallel_size = compile_config.tensor_parallel_size
    if tensor_parallel_size > 1 and kv_cache_dtype:
        raise InvalidArgument(f"kv_cache_dtype: {kv_cache_dtype!r} is not served over {tensor_parallel_size} ranks "
                              f"yet (tensor_parallel_size)")
    return EngineConfig(device=device, runtime_mode=mode, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                        gpu_memory_utilization=utilization, kv_cache_bytes=kv_cache_bytes,
                        capture_sizes=capture_sizes, max_num_waiting=max_num_waiting,
                        stream_interval=request.stream_interval or 1,
                        kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale,
                        quantization=compile_config.quantization,
                        quantize_head=request.quantize_head,
                        enable_prefix_caching=not request.HasField("enable_prefix_caching")
                        or request.enable_prefix_caching, piecewise_capture_sizes=piecewise,
                        tensor_parallel_size=tensor_parallel_size)


def default_capture_sizes(largest_batch: int) -> tuple[int, ...]:
    """[1, 2, 4] and the multiples of 8, up to the largest decode batch."""
    return tuple(s for s in (1, 2, 4, *range(8, largest_batch + 1, 8)) if s <= largest_batch)


def piecewise_capture_sizes(request: exec_pb2.LoadModelRequest, mode: RuntimeMode,
                            max_num_batched_tokens: int) -> tuple[int, ...]:
    """The token counts with mixed graphs: the defaults up to the step budget in cudagraph mode, () when off."""
    sizes = list(request.piecewise_capture_sizes)
    if not sizes:
        if mode != RuntimeMode.CUDAGRAPH:
            return ()
        return tuple(s for s in DEFAULT_PIECEWISE_CAPTURE_SIZES if s <= max_num_batched_tokens)
    if sizes == [0]:
        return ()
    for size in sizes:
        if size < 1:
            raise InvalidArgument(f"piecewise_capture_sizes: {size} is not a positive token count ([0] alone turns "
                                  f"mixed graphs off)")
    if max(sizes) > max_num_batched_tokens:
        raise InvalidArgument(f"piecewise_capture_sizes: {max(sizes)} exceeds max_num_batched_tokens "
                              f"{max_num_batched_tokens}")
    if mode != RuntimeMode.CUDAGRAPH:
        raise InvalidArgument(f"piecewise_capture_sizes: given, but runtime_mode is {mode}")
    return tuple(sorted(set(sizes)))


def _kv_cache_dtype(request: exec_pb2.LoadModelRequest, device: str) -> tuple[str, float]:
    name = request.kv_cache_dtype
    if name and name not in KV_CACHE_DTYPES:
        raise InvalidArgument(f"kv_cache_dtype: {name!r} is not one of {', '.join(map(repr, KV_CACHE_DTYPES))} "
                              f"(empty: the model's dtype)")
    scale = request.kv_cache_scale or 1.0
    if request.kv_cache_scale and not name:
        raise InvalidArgument("kv_cache_scale: given, but kv_cache_dtype is the model's dtype (set fp8_e4m3)")
    if name and device == "cuda":  # the CPU reference casts with torch, which every CPU build does
        why = fp8_unsupported(device)
        if why:
            raise InvalidArgument(f"kv_cache_dtype: {name!r} asked for, but {why}")
    return name, scale


def model_name(request: exec_pb2.LoadModelRequest, resolved: ResolvedModel) -> str:
    """The name clients use in Generate: the request's, or the preset's or directory's."""
    name = request.name or resolved.name
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"name: {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
                              f"letter or digit")
    return name
