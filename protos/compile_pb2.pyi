from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompileRequest(_message.Message):
    __slots__ = ("model", "config", "key_only")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    KEY_ONLY_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelSpec
    config: _common_pb2.CompileConfig
    key_only: bool
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelSpec, _Mapping]] = ..., config: _Optional[_Union[_common_pb2.CompileConfig, _Mapping]] = ..., key_only: _Optional[bool] = ...) -> None: ...

class CompileProgress(_message.Message):
    __slots__ = ("phase", "piece", "num_pieces", "size", "elapsed_s", "region")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    NUM_PIECES_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    phase: str
    piece: int
    num_pieces: int
    size: str
    elapsed_s: float
    region: str
    def __init__(self, phase: _Optional[str] = ..., piece: _Optional[int] = ..., num_pieces: _Optional[int] = ..., size: _Optional[str] = ..., elapsed_s: _Optional[float] = ..., region: _Optional[str] = ...) -> None: ...

class CompileResult(_message.Message):
    __slots__ = ("key", "cache_hit", "timings", "bundle_bytes", "num_pieces", "total_s", "num_splits", "key_factors_json")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PIECES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SPLITS_FIELD_NUMBER: _ClassVar[int]
    KEY_FACTORS_JSON_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ArtifactKey
    cache_hit: bool
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.PhaseTiming]
    bundle_bytes: int
    num_pieces: int
    total_s: float
    num_splits: int
    key_factors_json: str
    def __init__(self, key: _Optional[_Union[_common_pb2.ArtifactKey, _Mapping]] = ..., cache_hit: _Optional[bool] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.PhaseTiming, _Mapping]]] = ..., bundle_bytes: _Optional[int] = ..., num_pieces: _Optional[int] = ..., total_s: _Optional[float] = ..., num_splits: _Optional[int] = ..., key_factors_json: _Optional[str] = ...) -> None: ...

class CompileEvent(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: CompileProgress
    result: CompileResult
    def __init__(self, progress: _Optional[_Union[CompileProgress, _Mapping]] = ..., result: _Optional[_Union[CompileResult, _Mapping]] = ...) -> None: ...

class GetArtifactRequest(_message.Message):
    __slots__ = ("key", "chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ArtifactKey
    chunk_bytes: int
    def __init__(self, key: _Optional[_Union[_common_pb2.ArtifactKey, _Mapping]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ArtifactHeader(_message.Message):
    __slots__ = ("total_bytes", "manifest_json", "signature_json")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_JSON_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    manifest_json: str
    signature_json: str
    def __init__(self, total_bytes: _Optional[int] = ..., manifest_json: _Optional[str] = ..., signature_json: _Optional[str] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ArtifactHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ArtifactHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("key", "model", "config_summary", "size_bytes", "created_unix", "last_used_unix", "num_pieces")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    NUM_PIECES_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ArtifactKey
    model: str
    config_summary: str
    size_bytes: int
    created_unix: float
    last_used_unix: float
    num_pieces: int
    def __init__(self, key: _Optional[_Union[_common_pb2.ArtifactKey, _Mapping]] = ..., model: _Optional[str] = ..., config_summary: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., last_used_unix: _Optional[float] = ..., num_pieces: _Optional[int] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("artifacts", "unreadable")
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    UNREADABLE_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    unreadable: _containers.RepeatedCompositeFieldContainer[UnreadableArtifact]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ..., unreadable: _Optional[_Iterable[_Union[UnreadableArtifact, _Mapping]]] = ...) -> None: ...

class UnreadableArtifact(_message.Message):
    __slots__ = ("name", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeleteArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ArtifactKey
    def __init__(self, key: _Optional[_Union[_common_pb2.ArtifactKey, _Mapping]] = ...) -> None: ...

class DeleteArtifactResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...
