"""Model specs: a preset, a local Hugging Face directory, a Hub id (its snapshot in the server's Hugging Face
cache) or an inline config.json, resolved to an HF config."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, PretrainedConfig

from kiln.errors import InvalidArgument, NotFound, quote
from kiln.json_object import parse_json_object
from kiln.model import features as model_features
from kiln.model.presets import PRESETS
from kiln.model.roots import ModelRoots, PinnedDir

if TYPE_CHECKING:  # the wire type is read field by field; the engine below the API edge loads no protobuf
    from protos import common_pb2

# A model config is a few KB; past this it is refused before it is parsed (a Compile whose config carried tens of MB
# of junk once took the compile service past 15 GB of memory while it parsed, copied and hashed it).
MAX_CONFIG_JSON_BYTES = 1 << 20

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The sizes a decoder config gives, each a positive integer up to a bound far above any real model's: a wrong type
# or a negative size is the caller's error, named here, not a crash inside torch.
SIZE_FIELDS = {"hidden_size": 1 << 17, "intermediate_size": 1 << 19, "num_hidden_layers": 1 << 10,
               "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10, "vocab_size": 1 << 23,
               "max_position_embeddings": 1 << 24, "head_dim": 1 << 12}
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


@dataclass
class ResolvedModel:
    name: str
    config: PretrainedConfig
    dtype: torch.dtype
    hf_dir: Path | None  # the pinned view of a client-named directory: exactly the files its check opened
    pinned: PinnedDir | None = None  # holds them open while the model is in use

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(spec: "common_pb2.ModelSpec", device: str, roots: ModelRoots | None = None) -> ResolvedModel:
    """Turn a wire ModelSpec into an HF config and dtype, or raise a status the client can act on. A directory is
    read only under ``roots``; the servers always pass theirs, and None (a caller in this process, not a client)
    reads any directory."""
    source = spec.WhichOneof("source")
    hf_dir = pinned = None
    if source == "preset":
        if spec.preset not in PRESETS:
            raise NotFound(f"model.preset: unknown preset {quote(spec.preset)}; known: {', '.join(sorted(PRESETS))}")
        name, raw = spec.preset, dict(PRESETS[spec.preset])
    elif source in ("hf_dir", "hub_id"):
        field, named = f"model.{source}", getattr(spec, source)
        roots = roots or ModelRoots(any_path=True)
        if source == "hf_dir":
            pinned, name = roots.check_dir(spec.hf_dir, field), Path(spec.hf_dir).name
        else:  # named after the repository: org/name@revision -> name
            pinned, name = roots.hub_dir(spec.hub_id, field), spec.hub_id.split("@")[0].split("/")[1]
        text = pinned.read("config.json", MAX_CONFIG_JSON_BYTES)
        if text is None:
            raise NotFound(f"{field}: no config.json in {quote(named)}")
        if len(text) > MAX_CONFIG_JSON_BYTES:
            raise InvalidArgument(f"{field}: its config.json is over {MAX_CONFIG_JSON_BYTES} bytes")
        raw = parse_json_object(text, f"{field} config.json")
        hf_dir = pinned.view
    elif source == "config_json":
        if len(spec.config_json) > MAX_CONFIG_JSON_BYTES:  # characters: a lower bound on its bytes
            raise InvalidArgument(f"model.config_json: {len(spec.config_json)} characters, over the "
                                  f"{MAX_CONFIG_JSON_BYTES}-byte limit")
        raw = parse_json_object(spec.config_json, "model.config_json")
        name = raw.get("model_type", "model")
    else:
        raise InvalidArgument("model: set one of preset, hf_dir, hub_id or config_json")
    config = _build_config(raw)
    model_features.check(config, device)
    return ResolvedModel(name=name, config=config, dtype=_dtype(spec.dtype, device), hf_dir=hf_dir,
                         pinned=pinned)


def _build_config(raw: dict) -> PretrainedConfig:
    model_type = raw.get("model_type")
    if model_type not in model_features.FAMILIES:
        moe = model_features.is_mixture_of_experts(model_type)
        kind = "a mixture-of-experts model" if moe else "not a supported decoder architecture"
        supported = ", ".join(sorted(model_features.FAMILIES))
        raise InvalidArgument(f"model config: model_type {quote(model_type)} is {kind}; supported: {supported}")
    model_features.check_raw(raw)
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - transformers' checks of the caller's fields (strict dataclasses)
        raise InvalidArgument(f"model config: {' '.join(str(exc).split())[:300]}") from None
    _check_sizes(config)
    return config


def _check_sizes(config: PretrainedConfig) -> None:
    """Every size the model is built from is a positive integer within bounds, and the heads divide evenly."""
    for name, bound in SIZE_FIELDS.items():
        value = getattr(config, name, None)
        if value is None and name in ("head_dim", "num_key_value_heads"):
            continue  # derived from hidden_size / num_attention_heads
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
            raise InvalidArgument(f"model config: {name}: {quote(value)} is not an integer in [1, {bound}]")
    for name in POSITIVE_FLOAT_FIELDS:
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value) or value <= 0):
            raise InvalidArgument(f"model config: {name}: {quote(value)} is not a positive number")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    if heads % kv_heads:
        raise InvalidArgument(f"model config: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}")
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise InvalidArgument(f"model config: hidden_size {config.hidden_size} is not a multiple of "
                              f"num_attention_heads {heads} (and no head_dim is given)")


def _dtype(name: str, device: str) -> torch.dtype:
    if not name:
        return torch.bfloat16 if device == "cuda" else torch.float32
    if name not in DTYPES:
        raise InvalidArgument(f"model.dtype: {quote(name)} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]
