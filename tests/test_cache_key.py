"""The artifact key moves with what changes the generated code, and with nothing else."""

import copy
import json

from conftest import ANOTHER_TORCH, TINY_CONFIG, TINY_MODEL

from kiln import cache_key
from kiln.compile_config import CompileConfig
from kiln.model import build_model
from kiln.model_spec import resolve
from protos import common_pb2


def _key(model_spec=TINY_MODEL, config=TINY_CONFIG) -> str:
    compile_config = CompileConfig.from_proto(config)
    return cache_key.digest(cache_key.key_factors(resolve(model_spec, "cpu"), compile_config))


def _config(**fields) -> common_pb2.CompileConfig:
    config = copy.deepcopy(TINY_CONFIG)
    for name, value in fields.items():
        if name == "compile_sizes":
            config.compile_sizes[:] = value
        else:
            setattr(config, name, value)
    return config


def test_key_ignores_store_port_path_and_weights(tmp_path, compile_server, tiny_key):
    assert _key() == tiny_key  # computed here, with no server, store or port in sight
    # The same config from a saved HF directory (with real weights in it) keys the same as the preset.
    model = build_model(resolve(TINY_MODEL, "cpu"), "cpu", seed=123)
    model.causal_lm.save_pretrained(tmp_path / "tiny")
    assert _key(common_pb2.ModelSpec(hf_dir=str(tmp_path / "tiny"))) == tiny_key
    moved = tmp_path / "elsewhere" / "tiny"
    (tmp_path / "tiny").rename(moved.parent.mkdir(parents=True) or moved)
    assert _key(common_pb2.ModelSpec(hf_dir=str(moved))) == tiny_key


def test_key_follows_dtype_sizes_config_and_torch_version():
    base = _key()
    assert _key(common_pb2.ModelSpec(preset="tiny-llama", dtype="bfloat16")) != base
    assert _key(config=_config(compile_sizes=[8, 16])) != base
    assert _key(config=_config(max_num_batched_tokens=256)) != base
    other_model = json.loads(json.dumps(resolve(TINY_MODEL, "cpu").config.to_dict()))
    other_model["num_hidden_layers"] = 3
    assert _key(common_pb2.ModelSpec(config_json=json.dumps(other_model))) != base
    factors = cache_key.key_factors(resolve(TINY_MODEL, "cpu"), CompileConfig.from_proto(TINY_CONFIG))
    assert cache_key.digest(factors) == base
    factors["environment"]["torch"] = ANOTHER_TORCH
    assert cache_key.digest(factors) != base


def test_environment_mismatch_names_the_factor():
    stored = cache_key.environment_factors("cpu") | {"torch": ANOTHER_TORCH}
    mismatches = cache_key.mismatched_environment(stored, "cpu")
    assert [m[0] for m in mismatches] == ["torch"]
    assert mismatches[0][1] == ANOTHER_TORCH
