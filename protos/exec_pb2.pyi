from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RuntimeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUNTIME_MODE_UNSPECIFIED: _ClassVar[RuntimeMode]
    RUNTIME_MODE_EAGER: _ClassVar[RuntimeMode]
    RUNTIME_MODE_COMPILED: _ClassVar[RuntimeMode]
    RUNTIME_MODE_CUDAGRAPH: _ClassVar[RuntimeMode]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
RUNTIME_MODE_UNSPECIFIED: RuntimeMode
RUNTIME_MODE_EAGER: RuntimeMode
RUNTIME_MODE_COMPILED: RuntimeMode
RUNTIME_MODE_CUDAGRAPH: RuntimeMode
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_FAILED: ModelState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class LoadModelRequest(_message.Message):
    __slots__ = ("name", "model", "config", "key", "weights", "weights_seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_bytes", "block_size", "capture_sizes", "runtime_mode", "max_num_waiting", "stream_interval", "kv_cache_dtype", "kv_cache_scale", "enable_prefix_caching", "piecewise_capture_sizes", "tensor_parallel_size", "quantize_head")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_SIZES_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SCALE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PIECEWISE_CAPTURE_SIZES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_HEAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: _common_pb2.ModelSpec
    config: _common_pb2.CompileConfig
    key: _common_pb2.ArtifactKey
    weights: str
    weights_seed: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    kv_cache_bytes: int
    block_size: int
    capture_sizes: _containers.RepeatedScalarFieldContainer[int]
    runtime_mode: RuntimeMode
    max_num_waiting: int
    stream_interval: int
    kv_cache_dtype: str
    kv_cache_scale: float
    enable_prefix_caching: bool
    piecewise_capture_sizes: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel_size: int
    quantize_head: bool
    def __init__(self, name: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelSpec, _Mapping]] = ..., config: _Optional[_Union[_common_pb2.CompileConfig, _Mapping]] = ..., key: _Optional[_Union[_common_pb2.ArtifactKey, _Mapping]] = ..., weights: _Optional[str] = ..., weights_seed: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., kv_cache_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., capture_sizes: _Optional[_Iterable[int]] = ..., runtime_mode: _Optional[_Union[RuntimeMode, str]] = ..., max_num_waiting: _Optional[int] = ..., stream_interval: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_cache_scale: _Optional[float] = ..., enable_prefix_caching: _Optional[bool] = ..., piecewise_capture_sizes: _Optional[_Iterable[int]] = ..., tensor_parallel_size: _Optional[int] = ..., quantize_head: _Optional[bool] = ...) -> None: ...

class StartupPhase(_message.Message):
    __slots__ = ("phase", "seconds", "detail", "progress", "step")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    phase: str
    seconds: float
    detail: str
    progress: bool
    step: str
    def __init__(self, phase: _Optional[str] = ..., seconds: _Optional[float] = ..., detail: _Optional[str] = ..., progress: _Optional[bool] = ..., step: _Optional[str] = ...) -> None: ...

class ModelSizing(_message.Message):
    __slots__ = ("key", "num_kv_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_bytes", "weights_bytes", "activation_peak_bytes", "cudagraph_bytes", "total_memory_bytes", "capture_sizes", "runtime_mode", "device", "timings", "vocab_size", "kv_window", "dtype", "kv_cache_dtype", "quantization", "prefix_caching", "stream_interval", "piecewise_capture_sizes", "piecewise_graph_bytes", "tensor_parallel_size", "quantize_head")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDAGRAPH_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_SIZES_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_MODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PIECEWISE_CAPTURE_SIZES_FIELD_NUMBER: _ClassVar[int]
    PIECEWISE_GRAPH_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_HEAD_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ArtifactKey
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    cudagraph_bytes: int
    total_memory_bytes: int
    capture_sizes: _containers.RepeatedScalarFieldContainer[int]
    runtime_mode: str
    device: str
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.PhaseTiming]
    vocab_size: int
    kv_window: int
    dtype: str
    kv_cache_dtype: str
    quantization: str
    prefix_caching: bool
    stream_interval: int
    piecewise_capture_sizes: _containers.RepeatedScalarFieldContainer[int]
    piecewise_graph_bytes: int
    tensor_parallel_size: int
    quantize_head: bool
    def __init__(self, key: _Optional[_Union[_common_pb2.ArtifactKey, _Mapping]] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., activation_peak_bytes: _Optional[int] = ..., cudagraph_bytes: _Optional[int] = ..., total_memory_bytes: _Optional[int] = ..., capture_sizes: _Optional[_Iterable[int]] = ..., runtime_mode: _Optional[str] = ..., device: _Optional[str] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.PhaseTiming, _Mapping]]] = ..., vocab_size: _Optional[int] = ..., kv_window: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., stream_interval: _Optional[int] = ..., piecewise_capture_sizes: _Optional[_Iterable[int]] = ..., piecewise_graph_bytes: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., quantize_head: _Optional[bool] = ...) -> None: ...

class LoadModelEvent(_message.Message):
    __slots__ = ("phase", "ready")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    phase: StartupPhase
    ready: ModelSizing
    def __init__(self, phase: _Optional[_Union[StartupPhase, _Mapping]] = ..., ready: _Optional[_Union[ModelSizing, _Mapping]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "state", "sizing", "error", "num_waiting", "num_running", "num_free_blocks", "peak_used_blocks", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prefix_cache_blocks", "prefix_cache_evicted_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SIZING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ModelState
    sizing: ModelSizing
    error: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    peak_used_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_blocks: int
    prefix_cache_evicted_blocks: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., sizing: _Optional[_Union[ModelSizing, _Mapping]] = ..., error: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., peak_used_blocks: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_evicted_blocks: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "messages", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "n")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    n: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens", "time_to_first_token_s", "total_s", "queue_s", "num_preemptions", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    time_to_first_token_s: float
    total_s: float
    queue_s: float
    num_preemptions: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., total_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "index", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetForwardStatsRequest(_message.Message):
    __slots__ = ("model", "reset")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    model: str
    reset: bool
    def __init__(self, model: _Optional[str] = ..., reset: _Optional[bool] = ...) -> None: ...

class BatchSizeStats(_message.Message):
    __slots__ = ("model", "batch_size", "count", "median_ms", "p90_ms", "p99_ms", "runtime_mode", "total_ms", "phase", "path", "host_wait_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_MS_FIELD_NUMBER: _ClassVar[int]
    P90_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_MODE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    batch_size: int
    count: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    runtime_mode: str
    total_ms: float
    phase: str
    path: str
    host_wait_ms: float
    def __init__(self, model: _Optional[str] = ..., batch_size: _Optional[int] = ..., count: _Optional[int] = ..., median_ms: _Optional[float] = ..., p90_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., runtime_mode: _Optional[str] = ..., total_ms: _Optional[float] = ..., phase: _Optional[str] = ..., path: _Optional[str] = ..., host_wait_ms: _Optional[float] = ...) -> None: ...

class GetForwardStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.RepeatedCompositeFieldContainer[BatchSizeStats]
    def __init__(self, stats: _Optional[_Iterable[_Union[BatchSizeStats, _Mapping]]] = ...) -> None: ...
