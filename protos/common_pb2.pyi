from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelSpec(_message.Message):
    __slots__ = ("preset", "hf_dir", "config_json", "hub_id", "dtype")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    HF_DIR_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    HUB_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    preset: str
    hf_dir: str
    config_json: str
    hub_id: str
    dtype: str
    def __init__(self, preset: _Optional[str] = ..., hf_dir: _Optional[str] = ..., config_json: _Optional[str] = ..., hub_id: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class SplittingOps(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ops: _Optional[_Iterable[str]] = ...) -> None: ...

class CompileConfig(_message.Message):
    __slots__ = ("splitting_ops", "compile_sizes", "max_num_batched_tokens", "inductor_config_patches_json", "device", "max_compiled_tokens", "quantization", "tensor_parallel_size")
    SPLITTING_OPS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SIZES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDUCTOR_CONFIG_PATCHES_JSON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPILED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    splitting_ops: SplittingOps
    compile_sizes: _containers.RepeatedScalarFieldContainer[int]
    max_num_batched_tokens: int
    inductor_config_patches_json: str
    device: str
    max_compiled_tokens: int
    quantization: str
    tensor_parallel_size: int
    def __init__(self, splitting_ops: _Optional[_Union[SplittingOps, _Mapping]] = ..., compile_sizes: _Optional[_Iterable[int]] = ..., max_num_batched_tokens: _Optional[int] = ..., inductor_config_patches_json: _Optional[str] = ..., device: _Optional[str] = ..., max_compiled_tokens: _Optional[int] = ..., quantization: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class ArtifactKey(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class PhaseTiming(_message.Message):
    __slots__ = ("phase", "seconds")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    seconds: float
    def __init__(self, phase: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
