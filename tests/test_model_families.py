"""Every supported family through the real servers with its own weights: greedy output equal to transformers'.

Each family is a tiny random model saved with ``save_pretrained`` (hidden 64, 2-3 layers), loaded by LoadModel from
that directory (config and safetensors) and compared token for token, in float32 on CPU, with transformers'
``generate`` on the same directory, for prompts shorter and longer than the sliding window (16 tokens) and one
longer than a step's token budget (128, so its prefill runs in chunks). Inductor on a 2-core CPU takes about a
minute per family, so the families in COMPILED run the compiled bundle and the others run eager: the same
attention op and forward context, without Inductor (the GPU tests compile every family).
"""

import pytest
import torch
from test_exec_service import greedy_concurrently, hf_greedy, prompt_of

from protos import common_pb2, exec_pb2

WINDOW = 16
# initializer_range 0.2 (transformers' 0.02 makes a tiny model repeat one token): outputs that depend on context.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2)

# model_type -> the config of its tiny model (on top of TINY): each family's own features switched on.
FAMILY_CONFIGS = {
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    # Layer 0 global, layers 1 and 2 local: Qwen2's use_sliding_window and max_window_layers.
    "qwen2": dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                  max_window_layers=1, tie_word_embeddings=True),
}
# The same weights with the family's features switched off: the test must see a difference, or it could not fail.
FEATURES_OFF = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False, layer_types=None),
}
COMPILED = {"mistral"}
FAMILY_COMPILE_CONFIG = common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=128)
PROMPT_LENGTHS = [5, 40, 150]
MAX_TOKENS = 24


def tiny_model(model_type: str, seed: int = 3):
    """transformers' own model of the family's tiny config with seeded random weights, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY, **FAMILY_CONFIGS[model_type])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def reference_model(path, **overrides):
    """transformers' model from ``path``, its config changed by ``overrides`` (its derived fields derived again)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = AutoConfig.from_pretrained(path).to_dict()
    fields.update(overrides)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """model_type -> a directory with its tiny model saved by transformers, made on first use."""
    made = {}

    def get(model_type: str):
        if model_type not in made:
            made[model_type] = tmp_path_factory.mktemp(f"family-{model_type}")
            tiny_model(model_type).save_pretrained(made[model_type])
        return made[model_type]

    return get


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_greedy_matches_transformers(exec_stub, family_dirs, model_type):
    path = family_dirs(model_type)
    name = f"family-{model_type}"
    mode = exec_pb2.RUNTIME_MODE_COMPILED if model_type in COMPILED else exec_pb2.RUNTIME_MODE_EAGER
    request = exec_pb2.LoadModelRequest(name=name, model=common_pb2.ModelSpec(hf_dir=str(path)), weights=str(path),
                                        config=FAMILY_COMPILE_CONFIG, runtime_mode=mode)
    events = list(exec_stub.LoadModel(request))
    assert events[-1].ready.runtime_mode == exec_pb2.RuntimeMode.Name(mode).removeprefix("RUNTIME_MODE_").lower()
    try:
        reference, plain = reference_model(path), reference_model(path, **FEATURES_OFF[model_type])
        prompts = [prompt_of(n, salt) for salt, n in enumerate(PROMPT_LENGTHS)]
        results = greedy_concurrently(exec_stub, name, prompts, MAX_TOKENS)
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            expected = hf_greedy(reference, prompt, MAX_TOKENS)
            assert tokens == expected, f"{model_type}, prompt of {len(prompt)} tokens"
            if len(prompt) > WINDOW:
                assert expected != hf_greedy(plain, prompt, MAX_TOKENS), f"{model_type}'s features change nothing"
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
