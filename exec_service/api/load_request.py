"""A LoadModelRequest checked at the edge: what to load and the engine's limits, every error naming its field."""

import re

from exec_service.api.runtime_modes import runtime_mode_from_proto
from exec_service.engine.engine_config import EngineConfig
from exec_service.startup.load_model import LoadTarget
from kiln.compilation.config import CompileConfig
from kiln.errors import InvalidArgument, NotFound, quote
from kiln.model.roots import ModelRoots
from kiln.model.spec import ResolvedModel, resolve
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
    compile_config = CompileConfig.from_proto(request.config)
    resolved = resolve(request.model, compile_config.device, roots)
    weights, pinned = request.weights or "dummy", None
    if weights != "dummy":
        pinned = roots.check_dir(weights, "weights")
        if not pinned.is_dir:
            raise NotFound(f"weights: {quote(weights)} is neither 'dummy' nor a directory with *.safetensors")
        weights = str(pinned.view)  # the files the check opened, never what the path names later
    return LoadTarget(
        name=model_name(request, resolved), spec=request.model, resolved=resolved, compile_config=compile_config,
        key=request.key.digest or None, engine_config=engine_config(request, resolved, compile_config.device),
        weights=weights, weights_seed=request.weights_seed, weights_dir=pinned)


def engine_config(request: exec_pb2.LoadModelRequest, resolved: ResolvedModel, device: str) -> EngineConfig:
    mode = runtime_mode_from_proto(request.runtime_mode, device)
    if mode == RuntimeMode.CUDAGRAPH and device != "cuda":
        raise InvalidArgument("runtime_mode: cudagraph needs CUDA; this model runs on cpu")
    positions = getattr(resolved.config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
    max_model_len = request.max_model_len or min(positions, DEFAULT_MAX_MODEL_LEN)
    if not 2 <= max_model_len <= positions:
        raise InvalidArgument(f"max_model_len: {max_model_len} is outside [2, {positions}] (the model's "
                              f"max_position_embeddings)")
    max_num_seqs = request.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    if max_num_seqs < 1:
        raise InvalidArgument(f"max_num_seqs: {max_num_seqs} must be positive")
    if request.max_num_batched_tokens < 0:
        raise InvalidArgument(f"max_num_batched_tokens: {request.max_num_batched_tokens} must be positive")
    utilization = request.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if not 0 < utilization <= 1:
        raise InvalidArgument(f"gpu_memory_utilization: {utilization} is outside (0, 1]")
    if request.kv_cache_bytes < 0:
        raise InvalidArgument(f"kv_cache_bytes: {request.kv_cache_bytes} must not be negative")
    kv_cache_bytes = request.kv_cache_bytes or (DEFAULT_CPU_KV_CACHE_BYTES if device == "cpu" else 0)
    block_size = request.block_size or DEFAULT_BLOCK_SIZE
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise InvalidArgument(f"block_size: {block_size} is not a power of two in [1, {MAX_BLOCK_SIZE}]")
    if request.capture_sizes and mode != RuntimeMode.CUDAGRAPH:
        raise InvalidArgument(f"capture_sizes: given, but runtime_mode is {mode}")
    for size in request.capture_sizes:
        if not 1 <= size <= max_num_seqs:
            raise InvalidArgument(f"capture_sizes: {size} is outside [1, max_num_seqs={max_num_seqs}]")
    capture_sizes = tuple(sorted(set(request.capture_sizes))) if mode == RuntimeMode.CUDAGRAPH else ()
    max_num_waiting = request.max_num_waiting or DEFAULT_MAX_NUM_WAITING
    if max_num_waiting < 1:
        raise InvalidArgument(f"max_num_waiting: {max_num_waiting} must be positive")
    return EngineConfig(device=device, runtime_mode=mode, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=request.max_num_batched_tokens, block_size=block_size,
                        gpu_memory_utilization=utilization, kv_cache_bytes=kv_cache_bytes,
                        capture_sizes=capture_sizes, max_num_waiting=max_num_waiting)


def model_name(request: exec_pb2.LoadModelRequest, resolved: ResolvedModel) -> str:
    """The name clients use in Generate: the request's, or the preset's or directory's."""
    name = request.name or resolved.name
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"name: {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
                              f"letter or digit")
    return name
