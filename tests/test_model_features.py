"""Honour or refuse: every field of every supported family's config class is classified, and a config that asks
for something Kiln does not compute is refused at Compile and at LoadModel with the field named."""

import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path

import grpc
import pytest
from conftest import TINY_CONFIG, compile_result

from kiln.errors import InvalidArgument
from kiln.model import features as model_features
from kiln.model.spec import resolve
from protos import common_pb2, exec_pb2

# config.<name> and getattr(config, "<name>") reads in transformers' modeling code.
_CONFIG_READ = re.compile(r"config\.(\w+)|getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']")
_NOT_READS = {"json"}  # "config.json" in docstrings


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _config_reads(module_name: str, config_class) -> set[str]:
    """Attribute names read off a config; the config class's methods and properties are code, not fields."""
    source = inspect.getsource(importlib.import_module(module_name))
    names = {a or b for a, b in _CONFIG_READ.findall(source)} - _NOT_READS

    def is_code(name: str) -> bool:
        attribute = inspect.getattr_static(config_class, name, None)
        return inspect.isroutine(attribute) or isinstance(attribute, property | staticmethod | classmethod)

    return {name for name in names if not is_code(name)}


@pytest.mark.parametrize("model_type", sorted(model_features.FAMILIES))
def test_every_field_that_reaches_the_forward_is_honoured_refused_or_neutral(model_type):
    """The config class's fields, and every config attribute its modeling code or the rope code reads."""
    config_class = _config_class(model_type)
    modeling = config_class.__module__.replace(".configuration_", ".modeling_")
    fields = model_features.declared_fields(config_class)
    reads = _config_reads(modeling, config_class) | _config_reads("transformers.modeling_rope_utils", config_class)
    family = model_features.FAMILIES[model_type]
    unclassified = sorted((fields | reads) - family.classified())
    assert not unclassified, f"{model_type}: classify each as honoured, conditional (refused for some values) or " \
                             f"neutral in kiln/model/features.py: {unclassified}"


@pytest.mark.parametrize("model_type", sorted(model_features.FAMILIES))
def test_a_family_lists_a_field_once(model_type):
    family = model_features.FAMILIES[model_type]
    groups = [model_features.HONOURED | family.honoured, model_features.NEUTRAL | family.neutral,
              set(family.checks())]
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            assert not (a & b) - {"head_dim"}, f"{model_type}: {sorted(a & b)} in two groups"


def _refusal(raw: dict, device: str = "cpu") -> str:
    with pytest.raises(InvalidArgument) as err:
        resolve(common_pb2.ModelSpec(config_json=json.dumps(raw)), device)
    return str(err.value)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)

# (config, the field the refusal must name, a phrase of its reason)
REFUSED = [
    (dict(TINY, model_type="llama", rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_parameters",
     "'dynamic'"),
    (dict(TINY, model_type="qwen3", rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8,
                                                      long_factor=[2.0] * 8, factor=4.0)),
     "rope_parameters", "'longrope'"),
    (dict(TINY, model_type="llama", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
     "quantization_config.quant_method", "'bitsandbytes'"),
    (dict(TINY, model_type="llama", head_dim=512), "head_dim", "CUDA"),
    (dict(TINY, model_type="mistral", sliding_window=0), "sliding_window", "at least 1"),
    (dict(TINY, model_type="qwen2", layer_types=["full_attention", "chunked_attention"]), "layer_types",
     "'chunked_attention'"),
]


@pytest.mark.parametrize("raw, name, reason", REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_refusal_names_the_field(raw, name, reason):
    message = _refusal(raw, device="cuda")
    assert f"model config {name}=" in message and reason in message and raw["model_type"] in message


def test_mixture_of_experts_is_refused_as_such():
    for model_type in ("mixtral", "qwen3_moe", "olmoe"):
        assert f"model_type {model_type!r} is a mixture-of-experts model" in _refusal(dict(model_type=model_type))
    assert "not a supported decoder architecture" in _refusal(dict(model_type="bert"))


def test_an_unreviewed_field_is_served_at_its_default_only():
    """A field a newer transformers adds, unknown to Kiln: here the Llama family without its review of mlp_bias."""
    config = resolve(common_pb2.ModelSpec(config_json=json.dumps(dict(TINY, model_type="llama"))), "cpu").config
    llama = model_features.FAMILIES["llama"]
    unreviewed = {"llama": dataclasses.replace(llama, honoured=llama.honoured - {"mlp_bias"})}
    model_features.check(config, "cpu", unreviewed)
    config.mlp_bias = True
    with pytest.raises(InvalidArgument, match="model config mlp_bias=True: Kiln has not reviewed this Llama field"):
        model_features.check(config, "cpu", unreviewed)
    model_features.check(config, "cpu")  # reviewed: honoured


def test_honoured_configs_resolve():
    for raw in [dict(TINY, model_type="mistral", sliding_window=None),
                dict(TINY, model_type="mistral", sliding_window=4096),
                dict(TINY, model_type="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1),
                dict(TINY, model_type="llama", rope_scaling=dict(rope_type="linear", factor=2.0)),
                dict(TINY, model_type="qwen2", use_sliding_window=False, tie_word_embeddings=True),
                dict(TINY, model_type="llama", attention_bias=True, mlp_bias=True, sliding_window=8)]:
        resolve(common_pb2.ModelSpec(config_json=json.dumps(raw)), "cpu")


# Refused through the real servers: at Compile, and at LoadModel in both the compiled and the eager runtime mode.
# (config, what the status details must say)
SERVED_REFUSALS = [
    (dict(TINY, model_type="llama", rope_scaling=dict(rope_type="dynamic", factor=2.0)),
     "model config rope_parameters="),
    (dict(TINY, model_type="llama", quantization_config={"quant_method": "awq"}),
     "model config quantization_config.quant_method='awq'"),
    (dict(TINY, model_type="gemma2", head_dim=16, use_bidirectional_attention=True),
     "model config use_bidirectional_attention=True"),
    (dict(TINY, model_type="gemma3_text", head_dim=16, attn_logit_softcapping=50.0),
     "model config attn_logit_softcapping=50.0"),
    (dict(TINY, model_type="mixtral", num_local_experts=4), "model_type 'mixtral' is a mixture-of-experts model"),
]
_ids = [raw["model_type"] + "-" + said.split("=")[0].split()[-1] for raw, said in SERVED_REFUSALS]


@pytest.mark.parametrize("raw, said", SERVED_REFUSALS, ids=_ids)
def test_compile_refuses_with_the_field_named(compile_stub, raw, said):
    with pytest.raises(grpc.RpcError) as err:
        compile_result(compile_stub, model=common_pb2.ModelSpec(config_json=json.dumps(raw)), config=TINY_CONFIG)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert said in err.value.details()


@pytest.mark.parametrize("mode", [exec_pb2.RUNTIME_MODE_COMPILED, exec_pb2.RUNTIME_MODE_EAGER])
@pytest.mark.parametrize("raw, said", SERVED_REFUSALS, ids=_ids)
def test_load_model_refuses_with_the_field_named(exec_stub, raw, said, mode):
    name = f"refused-{raw['model_type']}"
    request = exec_pb2.LoadModelRequest(name=name, model=common_pb2.ModelSpec(config_json=json.dumps(raw)),
                                        config=TINY_CONFIG, runtime_mode=mode)
    with pytest.raises(grpc.RpcError) as err:
        list(exec_stub.LoadModel(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert said in err.value.details()
    assert name not in {m.name for m in exec_stub.ListModels(exec_pb2.ListModelsRequest()).models}


def _readme_rows() -> dict[str, tuple[str, str, str]]:
    """model_type -> (honoured, refused, CPU test) of the README's Supported models table."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    rows = [re.match(r"\| [^|]*\(`(\w+)`\) \|([^|]*)\|([^|]*)\|([^|]*)\|$", line) for line in section.splitlines()]
    return {m[1]: (m[2], m[3], m[4].strip()) for m in rows if m and m[1] != "model_type"}  # not the header


def test_readme_table_matches_the_families_and_their_tests():
    from test_model_families import COMPILED

    rows = _readme_rows()
    assert set(rows) == set(model_features.FAMILIES)
    for model_type, family in model_features.FAMILIES.items():
        honoured, refused, tested = rows[model_type]
        assert family.honoured <= set(re.findall(r"`(\w+)`", honoured)), f"{model_type}: honoured fields"
        assert set(family.conditional) <= set(re.findall(r"`(\w+)`", refused)), f"{model_type}: refused fields"
        assert tested == ("compiled" if model_type in COMPILED else "eager"), model_type
