"""The request messages from plain values: one way to name a model and to build a compile config."""

import ast
import json
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import json_format

from kiln.model.hub import is_hub_id
from protos import common_pb2


def model_spec(model: str, dtype: str = "") -> common_pb2.ModelSpec:
    """A local path is a Hugging Face directory, ``org/name[@revision]`` (not a local path) a Hub id, anything else
    with a slash a directory too (the server says it has no config.json), the rest a preset name."""
    if Path(model).exists():
        return common_pb2.ModelSpec(hf_dir=str(Path(model).resolve()), dtype=dtype)
    if is_hub_id(model):
        return common_pb2.ModelSpec(hub_id=model, dtype=dtype)
    if "/" in model:
        return common_pb2.ModelSpec(hf_dir=str(Path(model).resolve()), dtype=dtype)
    return common_pb2.ModelSpec(preset=model, dtype=dtype)


def compile_config(device: str = "", compile_sizes: Iterable[int] = (), max_compiled_tokens: int = 0,
                   splitting_ops: Iterable[str] | None = None, inductor_config: str = "",
                   quantization: str = "") -> common_pb2.CompileConfig:
    """A CompileConfig; every value left out is the server's default (``splitting_ops`` None: Kiln's attention op,
    empty: one full graph)."""
    config = common_pb2.CompileConfig(device=device, compile_sizes=list(compile_sizes),
                                      max_compiled_tokens=max_compiled_tokens,
                                      inductor_config_patches_json=inductor_config, quantization=quantization)
    if splitting_ops is not None:
        config.splitting_ops.ops.extend(splitting_ops)
        config.splitting_ops.SetInParent()
    return config


def compile_config_from_text(text: str) -> common_pb2.CompileConfig:
    """A CompileConfig written as JSON, or as the Python dict literal vLLM's ``-O`` examples use; ValueError when it
    is neither, or names a field CompileConfig lacks."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        try:
            fields = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"neither JSON nor a Python dict: {exc}") from None
    try:
        return json_format.ParseDict(fields, common_pb2.CompileConfig())
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from None
