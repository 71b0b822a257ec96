"""The range of every number a client may send: one line per numeric field of every request message, checked at the
API edge before anything is read, allocated or looked up.

Each bound is what a server can hold (sequences, tokens, blocks, bytes), not what a request usually asks for: a
LoadModel with ``max_num_seqs`` 10,000,000 once took an execute service to 6 GB in two seconds before any check ran.
A value outside its range is INVALID_ARGUMENT naming the field (``config.compile_sizes[3]``); the narrower checks
that depend on the model (the vocabulary, max_model_len) come after, where the model is known. A field added to a
request message without a line here fails ``tests/test_faults_bounds.py``, which walks the descriptors.
"""

import math
import struct
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kiln.errors import InvalidArgument

# What a server can hold, in the units the fields count.
MAX_TOKENS_PER_SEQUENCE = 1 << 24  # a model config's largest max_position_embeddings (kiln.model.spec)
MAX_VOCAB = 1 << 23  # a model config's largest vocab_size: token ids lie below it
MAX_BATCHED_TOKENS = 1 << 17  # tokens in one step, the compiled symbolic range's upper end
MAX_COMPILE_SIZES = 64  # static shapes per compile: each one is a compile of every piece
MAX_NUM_SEQS = 4096  # sequences in one step: each has a CUDA graph size, sampler rows and block tables
MAX_NUM_WAITING = 1 << 16  # requests queued per model
MAX_STREAM_INTERVAL = 256  # tokens a stream gathers before it sends them
MAX_KV_CACHE_BYTES = 1 << 40  # 1 TiB: more than any one host's memory
MAX_BLOCK_SIZE = 256  # tokens per KV block
MAX_STOP_TOKEN_IDS = 1024
MAX_CHUNK_BYTES = 4 << 20  # GetArtifact's largest chunk, far below gRPC's message limit
MAX_SEED = (1 << 63) - 1  # any non-negative 64-bit seed
MAX_N = 64  # sequences sampled from one prompt
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_REPETITION_PENALTY = 10.0
MAX_PIECEWISE_SIZES = 64  # token counts with mixed CUDA graphs: each is a capture of the whole step
MAX_KV_CACHE_SCALE = 1000.0  # an FP8 KV cache's scale
MAX_TENSOR_PARALLEL_SIZE = 8  # ranks: the GPUs of one host (kiln.model.tensor_parallel, which imports no protobuf)


@dataclass(frozen=True)
class Bound:
    """``low <= value <= high`` (``low < value`` with ``low_open``); a repeated field also holds at most
    ``max_count`` values. ``note`` says what a zero or an unset value means, for the message."""

    low: float
    high: float
    max_count: int | None = None
    low_open: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def says(self) -> str:
        interval = f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"
        return f"{interval}{f'; {self.note}' if self.note else ''}"


# Full proto field name -> its range. Keep one line per field; the proto comment states the same range.
BOUNDS: dict[str, Bound] = {
    # common.proto
    "kiln.v1.CompileConfig.compile_sizes": Bound(1, MAX_BATCHED_TOKENS, max_count=MAX_COMPILE_SIZES),
    "kiln.v1.CompileConfig.max_compiled_tokens": Bound(0, MAX_BATCHED_TOKENS, note="0 means 512"),
    "kiln.v1.CompileConfig.max_num_batched_tokens": Bound(0, MAX_BATCHED_TOKENS,
                                                          note="the old name of max_compiled_tokens"),
    "kiln.v1.CompileConfig.tensor_parallel_size": Bound(0, MAX_TENSOR_PARALLEL_SIZE, note="0 means 1"),
    # compile.proto
    "kiln.v1.GetArtifactRequest.chunk_bytes": Bound(0, MAX_CHUNK_BYTES, note="0 means 1 MiB"),
    # exec.proto: LoadModelRequest
    "kiln.v1.LoadModelRequest.weights_seed": Bound(0, MAX_SEED),
    "kiln.v1.LoadModelRequest.max_model_len": Bound(0, MAX_TOKENS_PER_SEQUENCE, note="0 means the model's, up to 4096"),
    "kiln.v1.LoadModelRequest.max_num_seqs": Bound(0, MAX_NUM_SEQS, note="0 means 64"),
    "kiln.v1.LoadModelRequest.max_num_batched_tokens": Bound(0, MAX_BATCHED_TOKENS, note="0 means the compile's"),
    "kiln.v1.LoadModelRequest.gpu_memory_utilization": Bound(0, 1, note="0 means 0.9"),
    "kiln.v1.LoadModelRequest.kv_cache_bytes": Bound(0, MAX_KV_CACHE_BYTES, note="0 means the default"),
    "kiln.v1.LoadModelRequest.block_size": Bound(0, MAX_BLOCK_SIZE, note="0 means 16"),
    "kiln.v1.LoadModelRequest.capture_sizes": Bound(1, MAX_NUM_SEQS, max_count=MAX_NUM_SEQS),
    "kiln.v1.LoadModelRequest.max_num_waiting": Bound(0, MAX_NUM_WAITING, note="0 means 256"),
    "kiln.v1.LoadModelRequest.stream_interval": Bound(0, MAX_STREAM_INTERVAL, note="0 means 1"),
    "kiln.v1.LoadModelRequest.piecewise_capture_sizes": Bound(0, MAX_BATCHED_TOKENS, max_count=MAX_PIECEWISE_SIZES,
                                                              note="[0] turns mixed graphs off"),
    "kiln.v1.LoadModelRequest.kv_cache_scale": Bound(0, MAX_KV_CACHE_SCALE, note="0 means 1.0"),
    "kiln.v1.LoadModelRequest.tensor_parallel_size": Bound(0, MAX_TENSOR_PARALLEL_SIZE, note="0 means 1"),
    # exec.proto: GenerateRequest
    "kiln.v1.GenerateRequest.prompt_ids": Bound(0, MAX_VOCAB - 1, max_count=MAX_TOKENS_PER_SEQUENCE),
    "kiln.v1.GenerateRequest.max_tokens": Bound(1, MAX_TOKENS_PER_SEQUENCE, note="unset means 16"),
    "kiln.v1.GenerateRequest.temperature": Bound(0, 100, note="0 is greedy"),
    "kiln.v1.GenerateRequest.top_p": Bound(0, 1, low_open=True),
    "kiln.v1.GenerateRequest.top_k": Bound(0, MAX_VOCAB, note="0 keeps every token"),
    "kiln.v1.GenerateRequest.seed": Bound(0, MAX_SEED),
    "kiln.v1.GenerateRequest.stop_token_ids": Bound(0, MAX_VOCAB - 1, max_count=MAX_STOP_TOKEN_IDS),
    "kiln.v1.GenerateRequest.top_logprobs": Bound(0, MAX_TOP_LOGPROBS),
    "kiln.v1.GenerateRequest.presence_penalty": Bound(-2, 2),
    "kiln.v1.GenerateRequest.frequency_penalty": Bound(-2, 2),
    "kiln.v1.GenerateRequest.repetition_penalty": Bound(0, MAX_REPETITION_PENALTY, low_open=True,
                                                        note="unset means 1"),
    "kiln.v1.GenerateRequest.min_tokens": Bound(0, MAX_TOKENS_PER_SEQUENCE),
    "kiln.v1.GenerateRequest.n": Bound(0, MAX_N, note="0 means 1"),
}

NUMERIC_TYPES = frozenset({
    FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_SFIXED64,
    FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE,
})


def check_request(request: Message) -> None:
    """INVALID_ARGUMENT naming the first numeric field of ``request`` (nested messages included) outside its range;
    a numeric field with no line in BOUNDS is refused too, so that no field is ever taken unbounded."""
    _check(request, "")


def _check(message: Message, prefix: str) -> None:
    for field, value in message.ListFields():  # set fields only: an unset one takes its documented default
        name = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for i, item in enumerate(value) if _repeated(field) else ((None, value),):
                _check(item, f"{name}[{i}]." if i is not None else f"{name}.")
            continue
        if field.type not in NUMERIC_TYPES:
            continue
        bound = BOUNDS.get(field.full_name)
        if bound is None:
            raise InvalidArgument(f"{name}: this server has no range for the field; it refuses it rather than "
                                  f"take it unbounded")
        values = value if _repeated(field) else (value,)
        if bound.max_count is not None and len(values) > bound.max_count:
            raise InvalidArgument(f"{name}: {len(values)} values, more than the {bound.max_count} it may hold")
        if values and isinstance(values[0], int) and bound.holds(min(values)) and bound.holds(max(values)):
            continue  # a prompt of 100k token ids is checked at C speed; the offender is looked for below
        for i, item in enumerate(values):
            if not bound.holds(item):
                where = f"{name}[{i}]" if _repeated(field) else name
                raise InvalidArgument(f"{where}: {_sent(item)} is outside {bound.says()}")


def _repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


_FLOAT32_MAX = 3.4028234663852886e38


def _number(value: float) -> str:
    """A bound as written (``10``, ``0.5``)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def as_sent(value: float) -> float:
    """A proto float as the client wrote it: a float32 field's shortest decimal (0.8, not the 0.800000011920929 that
    float32 widens to), a double's shortest repr; so messages, sampling, spans and logs see the number sent."""
    if not math.isfinite(value):
        return value
    for digits in range(1, 18):
        shortest = float(f"{value:.{digits}g}")
        if shortest == value or (abs(shortest) <= _FLOAT32_MAX
                                 and struct.unpack("f", struct.pack("f", shortest))[0] == value):
            return shortest
    return value


def _sent(value: float) -> str:
    return repr(as_sent(value)) if isinstance(value, float) else str(value)
