"""Parsers bounded, through the real compile service: JSON past what Python's parser bounds itself (nesting, integer
digits, encoding, NaN, keys twice) is INVALID_ARGUMENT naming the field, never INTERNAL; config fields that would
choose code are refused; Inductor options of the wrong type or not the client's get the precise status."""

import hashlib
import json

import grpc
import pytest

from kiln.store import bundle
from protos import common_pb2, compile_pb2

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
LLAMA_JSON = json.dumps(LLAMA)


def refusal(stub, model: common_pb2.ModelSpec, **config) -> grpc.RpcError:
    request = compile_pb2.CompileRequest(model=model, key_only=True,
                                         config=common_pb2.CompileConfig(device="cpu", **config))
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Compile(request, timeout=60))
    return refused.value


@pytest.mark.parametrize("text, says", [
    (LLAMA_JSON[:-1] + ', "junk": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 64 deep"),
    (LLAMA_JSON[:-1] + ', "junk": ' + "9" * 5000 + "}", "an integer of 5000 digits, more than 24"),
    (LLAMA_JSON[:-1] + ', "rms_norm_eps": NaN}', "NaN is not JSON"),
    (LLAMA_JSON[:-1] + ', "rms_norm_eps": 1e999}', "1e999 is not a finite number"),
    (LLAMA_JSON[:-1] + ', "vocab_size": 256}', "the key 'vocab_size' appears twice"),
])
def test_json_past_a_bound_is_invalid_argument_naming_the_field(compile_stub, text, says):
    error = refusal(compile_stub, common_pb2.ModelSpec(config_json=text))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == f"model.config_json: {says}"


def test_a_directorys_config_json_that_is_not_utf8_is_invalid_argument(compile_stub, tmp_path):
    (tmp_path / "config.json").write_bytes(LLAMA_JSON[:-1].encode() + b', "name": "\xff\xfe"}')
    error = refusal(compile_stub, common_pb2.ModelSpec(hf_dir=str(tmp_path)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("model.hf_dir config.json: not UTF-8")


def test_inductor_patches_nested_too_deep_are_invalid_argument(compile_stub):
    error = refusal(compile_stub, common_pb2.ModelSpec(config_json=LLAMA_JSON),
                    inductor_config_patches_json='{"max_autotune": ' + "[" * 20_000 + "]" * 20_000 + "}")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("config.inductor_config_patches_json: nested more than 64 deep")


@pytest.mark.parametrize("fields, name", [
    ({"attn_implementation": "kernels-community/flash-attn"}, "attn_implementation"),
    ({"_attn_implementation": "flash_attention_2"}, "_attn_implementation"),
    ({"experts_implementation": "grouped_mm"}, "experts_implementation"),
    ({"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "auto_map"),
    ({"rope_parameters": {"rope_type": "default", "attn_implementation": "sdpa"}},
     "rope_parameters.attn_implementation"),
])
def test_config_fields_that_choose_code_are_refused(compile_stub, fields, name):
    error = refusal(compile_stub, common_pb2.ModelSpec(config_json=json.dumps({**LLAMA, **fields})))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"model config {name}: chooses code to run"), error.details()


def test_a_null_implementation_chooses_nothing_and_is_served(compile_stub):
    request = compile_pb2.CompileRequest(model=common_pb2.ModelSpec(config_json=json.dumps(
        {**LLAMA, "attn_implementation": None})), config=common_pb2.CompileConfig(device="cpu"), key_only=True)
    (event,) = compile_stub.Compile(request, timeout=60)
    assert event.HasField("result")


@pytest.mark.parametrize("patches, code, says", [
    ({"triton.multi_kernel": 1.0}, grpc.StatusCode.INVALID_ARGUMENT, "triton.multi_kernel is 1.0; it takes one of"),
    ({"triton.multi_kernel": True}, grpc.StatusCode.INVALID_ARGUMENT, "triton.multi_kernel is True; it takes one of"),
    ({"max_fusion_size": 64.0}, grpc.StatusCode.INVALID_ARGUMENT, "max_fusion_size is 64.0; it takes an integer"),
    ({"force_disable_caches": True}, grpc.StatusCode.PERMISSION_DENIED, "force_disable_caches is the operator's"),
    ({"use_static_triton_launcher": False}, grpc.StatusCode.PERMISSION_DENIED,
     "use_static_triton_launcher is not on Kiln's allowlist"),
])
def test_inductor_options_of_the_wrong_type_or_not_the_clients(compile_stub, patches, code, says):
    error = refusal(compile_stub, common_pb2.ModelSpec(config_json=LLAMA_JSON),
                    inductor_config_patches_json=json.dumps(patches))
    assert error.code() == code, error.details()
    assert error.details().startswith(f"config.inductor_config_patches_json: {says}"), error.details()


def test_a_store_manifest_nested_too_deep_is_listed_as_unreadable(compile_stub, compile_store):
    key = hashlib.sha256(b"deep manifest").hexdigest()
    (compile_store / key).mkdir()
    (compile_store / key / bundle.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    try:
        listed = compile_stub.ListArtifacts(compile_pb2.ListArtifactsRequest(), timeout=30)
        (unreadable,) = [u for u in listed.unreadable if u.name == key]
        assert "nested more than 64 deep" in unreadable.reason
        assert not (compile_store / key).exists(), "the compile service took it out of the store"
    finally:
        if (compile_store / key).exists():
            (compile_store / key / bundle.MANIFEST).unlink()
            (compile_store / key).rmdir()
