"""The compile config: strict, validated at the edge, and canonical so that it can be a cache-key factor."""

import json
from dataclasses import asdict, dataclass, field

from kiln.attention.op import ATTENTION_OP_NAME
from kiln.compilation.inductor_options import parse_patches
from kiln.errors import InvalidArgument, quote
from kiln.model.spec import default_device
from kiln.model.tensor_parallel import MAX_TENSOR_PARALLEL_SIZE
from kiln.quantization.model_quantization import QUANTIZATIONS, check_supported, quantization_of
from protos import common_pb2

DEFAULT_MAX_COMPILED_TOKENS = 512
# The compiled range's bounds: a range of one token is a static shape, and the profile forward runs the largest.
MIN_COMPILED_TOKENS = 2
MAX_COMPILED_TOKENS = 131072
# Ops the graph may be split at: opaque to Inductor, so nothing is lost by cutting there.
KNOWN_SPLITTING_OPS = (ATTENTION_OP_NAME,)


@dataclass(frozen=True)
class CompileConfig:
    splitting_ops: tuple[str, ...] = (ATTENTION_OP_NAME,)  # empty: one full graph
    compile_sizes: tuple[int, ...] = ()  # token counts compiled statically besides the symbolic shape
    max_compiled_tokens: int = DEFAULT_MAX_COMPILED_TOKENS  # the symbolic token range is [1, this]
    inductor_config_patches: dict = field(default_factory=dict)
    device: str = "cpu"
    quantization: str = ""  # "fp8", or empty (kiln.quantization.model_quantization)
    tensor_parallel_size: int = 1  # ranks the compiled layer is one shard of (kiln.model.tensor_parallel)

    def factors(self) -> dict:
        d = asdict(self)
        d["splitting_ops"] = list(self.splitting_ops)
        d["compile_sizes"] = list(self.compile_sizes)
        return d

    def summary(self) -> str:
        split = ",".join(self.splitting_ops) or "full-graph"
        sizes = ",".join(map(str, self.compile_sizes)) or "-"
        quantized = f" {self.quantization}" if self.quantization else ""
        quantized += f" tp={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return f"{self.device}{quantized} split={split} sizes={sizes} max_compiled_tokens={self.max_compiled_tokens}"

    @classmethod
    def from_proto(cls, msg: common_pb2.CompileConfig) -> "CompileConfig":
        """Validate a wire config; every error names its field."""
        device = msg.device or default_device()
        if device not in ("cpu", "cuda"):
            raise InvalidArgument(f"config.device: {quote(device)} is not 'cpu' or 'cuda'")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise InvalidArgument("config.device: 'cuda' asked for but this server has no CUDA device")
        max_tokens = compiled_range(msg)
        splitting_ops = tuple(msg.splitting_ops.ops) if msg.HasField("splitting_ops") else (ATTENTION_OP_NAME,)
        for op in splitting_ops:
            if op not in KNOWN_SPLITTING_OPS:
                raise InvalidArgument(
                    f"config.splitting_ops: unknown op {quote(op)}; known: {', '.join(KNOWN_SPLITTING_OPS)}"
                )
        for size in msg.compile_sizes:
            if not 1 <= size <= max_tokens:
                raise InvalidArgument(
                    f"config.compile_sizes: {size} is outside the symbolic range [1, {max_tokens}]"
                )
        # Only options on Kiln's allowlist: some others name binaries, paths or callables
        # (kiln/compilation/inductor_options.py).
        patches = parse_patches(msg.inductor_config_patches_json) if msg.inductor_config_patches_json else {}
        if msg.quantization not in QUANTIZATIONS:
            raise InvalidArgument(f"config.quantization: {quote(msg.quantization)} is not one of "
                                  f"{', '.join(repr(q) for q in QUANTIZATIONS)} (empty: none)")
        if msg.quantization:
            check_supported(quantization_of(None, msg.quantization), device, "config.quantization")
        tensor_parallel_size = msg.tensor_parallel_size or 1
        if not 1 <= tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise InvalidArgument(f"config.tensor_parallel_size: {msg.tensor_parallel_size} is outside "
                                  f"[1, {MAX_TENSOR_PARALLEL_SIZE}] (0: 1)")
        return cls(
            splitting_ops=tuple(dict.fromkeys(splitting_ops)),
            compile_sizes=tuple(sorted(set(msg.compile_sizes))),
            max_compiled_tokens=max_tokens,
            inductor_config_patches=dict(sorted(patches.items())),
            device=device,
            quantization=msg.quantization,
            tensor_parallel_size=tensor_parallel_size,
        )

    def to_proto(self) -> common_pb2.CompileConfig:
        return common_pb2.CompileConfig(
            splitting_ops=common_pb2.SplittingOps(ops=list(self.splitting_ops)),
            compile_sizes=list(self.compile_sizes),
            max_compiled_tokens=self.max_compiled_tokens,
            inductor_config_patches_json=json.dumps(self.inductor_config_patches, sort_keys=True),
            device=self.device,
            quantization=self.quantization,
            tensor_parallel_size=self.tensor_parallel_size,
        )


def compiled_range(msg: common_pb2.CompileConfig) -> int:
    """``max_compiled_tokens``, or the deprecated field of the same meaning that older requests set, checked."""
    field, value = "max_compiled_tokens", msg.max_compiled_tokens
    legacy = msg.max_num_batched_tokens  # the old name, read for requests written before the budget had its own
    if legacy and value and legacy != value:
        raise InvalidArgument(f"config.max_num_batched_tokens: {legacy} differs from config.max_compiled_tokens "
                              f"{value}; it is the old name of max_compiled_tokens: set only that")
    if legacy and not value:
        field, value = "max_num_batched_tokens", legacy
    value = value or DEFAULT_MAX_COMPILED_TOKENS
    if not MIN_COMPILED_TOKENS <= value <= MAX_COMPILED_TOKENS:
        raise InvalidArgument(f"config.{field}: {value} is outside [{MIN_COMPILED_TOKENS}, {MAX_COMPILED_TOKENS}]")
    return value
