"""Every supported family through the real servers with its own weights: greedy output equal to transformers'.

Each family is a tiny random model saved with ``save_pretrained`` (hidden 64, 2-3 layers), loaded by LoadModel from
that directory (config and safetensors) and compared token for token, in float32 on CPU, with transformers'
``generate`` on the same directory, for prompts shorter and longer than the sliding window (16 tokens) and one
longer than a step's token budget (128, so its prefill runs in chunks). Inductor on a 2-core CPU takes about 40 s
per family, so the families in COMPILED run the compiled bundle and the others run eager: the same attention op
and forward context, without Inductor. Every family is traced by Dynamo whole (cheap, no Inductor), and the GPU
tests (tests/test_gpu_families.py) compile every family.
"""

import json

import pytest
import torch
from test_exec_service import greedy_concurrently, hf_greedy, prompt_of

from protos import common_pb2, exec_pb2

WINDOW = 16
SOFTCAP = 1.0  # small against the logits of the tiny models, so that capping them changes the output
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
# A tiny Gemma with tied embeddings (scaled by sqrt(hidden) on the way in) repeats one token whatever the prompt.
GEMMA = dict(head_dim=16, tie_word_embeddings=False)
# initializer_range 0.2 (transformers' 0.02 makes a tiny model repeat one token): outputs that depend on context.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2)

# model_type -> the config of its tiny model (on top of TINY): each family's own features switched on.
FAMILY_CONFIGS = {
    "llama": dict(model_type="llama", attention_bias=True, mlp_bias=True,
                  rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=256)),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    # Layer 0 global, layers 1 and 2 local: Qwen2's use_sliding_window and max_window_layers.
    "qwen2": dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                  max_window_layers=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  rope_scaling=dict(rope_type="linear", factor=2.0)),
    "gemma": dict(model_type="gemma", **GEMMA),
    # Local then global layer, attention logits capped, final logits capped, scaled embeddings (Gemma's own).
    "gemma2": dict(model_type="gemma2", **GEMMA, query_pre_attn_scalar=16, sliding_window=WINDOW,
                   attn_logit_softcapping=SOFTCAP, final_logit_softcapping=30.0),
    "gemma3_text": dict(model_type="gemma3_text", **GEMMA, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        layer_types=LOCAL_GLOBAL, final_logit_softcapping=30.0),
    # head_dim 24 (not a power of two), half of it rotary.
    "phi3": dict(model_type="phi3", hidden_size=96, sliding_window=WINDOW, partial_rotary_factor=0.5),
    "olmo2": dict(model_type="olmo2"),
    "olmo3": dict(model_type="olmo3", sliding_window=WINDOW, layer_types=LOCAL_GLOBAL),
    "granite": dict(model_type="granite", embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1,
                    logits_scaling=4.0),
    "starcoder2": dict(model_type="starcoder2", sliding_window=WINDOW),
    "cohere2": dict(model_type="cohere2", sliding_window=WINDOW, layer_types=LOCAL_GLOBAL, logit_scale=0.5),
    "ministral": dict(model_type="ministral", head_dim=16, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL),
    # Layer 1 has no rope and is local (SmolLM3's pattern, every 2nd layer here).
    "smollm3": dict(model_type="smollm3", use_sliding_window=True, sliding_window=WINDOW, no_rope_layer_interval=2),
    "exaone4": dict(model_type="exaone4", sliding_window=WINDOW, sliding_window_pattern=2),
    "helium": dict(model_type="helium", head_dim=16),
    "glm4": dict(model_type="glm4", head_dim=16, partial_rotary_factor=0.5),
}
# The same weights with one of the family's features switched off: each must change the output of the prompts
# longer than the window, or the test could not fail when Kiln ignored it.
ALL_GLOBAL = dict(layer_types=["full_attention"] * 2)
FEATURES_OFF = {
    "mistral": [dict(sliding_window=None)],
    "qwen2": [dict(use_sliding_window=False, layer_types=None)],
    "qwen3": [dict(use_sliding_window=False, layer_types=None)],
    "gemma2": [ALL_GLOBAL, dict(attn_logit_softcapping=None)],
    "gemma3_text": [ALL_GLOBAL],
    "phi3": [dict(sliding_window=None)],
    "olmo3": [ALL_GLOBAL],
    "starcoder2": [dict(sliding_window=None)],
    "cohere2": [ALL_GLOBAL],
    "ministral": [ALL_GLOBAL],
    "smollm3": [dict(use_sliding_window=False, layer_types=None)],
    "exaone4": [ALL_GLOBAL],
}
# Compiled on CPU: Mistral's pieces equal tiny-llama's, so they hit Inductor's cache (seconds); Gemma 2's are its own
# (about 40 s on 2 busy cores): softcaps, local/global layers and scaled embeddings through Inductor.
COMPILED = {"mistral", "gemma2"}
FAMILY_COMPILE_CONFIG = common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=128)
PROMPT_LENGTHS = [5, 40, 150]
MAX_TOKENS = 24


def test_every_supported_family_is_tested_here():
    from kiln.model.features import FAMILIES

    assert set(FAMILY_CONFIGS) == set(FAMILIES)


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
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                **reference_attention(config)).eval()


def reference_attention(config) -> dict:
    """transformers' eager attention for a model with capped attention logits: SDPA has no cap, and transformers
    5.17 (the GPU machine's) still lists Gemma 2 as SDPA-capable and drops the cap there (5.24 refuses SDPA)."""
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


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
        reference = reference_model(path)
        plain = [reference_model(path, **off) for off in FEATURES_OFF.get(model_type, [])]
        prompts = [prompt_of(n, salt) for salt, n in enumerate(PROMPT_LENGTHS)]
        results = greedy_concurrently(exec_stub, name, prompts, MAX_TOKENS)
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            expected = hf_greedy(reference, prompt, MAX_TOKENS)
            assert tokens == expected, f"{model_type}, prompt of {len(prompt)} tokens"
            for off, model in zip(FEATURES_OFF.get(model_type, []), plain, strict=True):
                if len(prompt) > WINDOW:
                    assert hf_greedy(model, prompt, MAX_TOKENS) != expected, f"{model_type}: {off} changes nothing"
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_logits_match_transformers_forward(family_dirs, model_type):
    """Kiln's module (no engine: one causal sequence) against the family's ForCausalLM: the logits themselves, so
    what its head does after lm_head (Gemma's final cap, Granite's and Cohere's scales) is checked, which greedy
    tokens alone cannot see."""
    from kiln.model.causal_lm import build_model
    from kiln.model.spec import resolve

    path = family_dirs(model_type)
    module = build_model(resolve(common_pb2.ModelSpec(hf_dir=str(path)), "cpu"), "cpu", weights=str(path))
    ids = torch.tensor(prompt_of(40))
    with torch.no_grad():
        logits = module.logits(module(ids, torch.arange(len(ids))))
        expected = reference_model(path)(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


WINDOW_ON_EVERY_LAYER = {"mistral", "phi3", "starcoder2"}  # no layer types: the config's window is every layer's
ATTENTION_SOFTCAP = {"gemma2"}


def _expected_layers(config) -> list[tuple[int, float]]:
    """(window, softcap) each layer's attention call must carry, from the config as transformers reads it."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    softcap = float(config.attn_logit_softcapping or 0.0) if config.model_type in ATTENTION_SOFTCAP else 0.0
    if config.model_type in WINDOW_ON_EVERY_LAYER:
        return [(window, softcap)] * config.num_hidden_layers
    return [(window if t == "sliding_attention" else 0, softcap) for t in layer_types]


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_dynamo_traces_one_graph_with_each_layers_window(model_type):
    """Dynamo (no Inductor) traces every family whole, token dimension symbolic, as the compile service does; each
    layer's attention call carries that layer's window and cap as constants, local and global layers apart."""
    from kiln.model.causal_lm import build_model
    from kiln.model.spec import resolve

    raw = dict(TINY, **FAMILY_CONFIGS[model_type])
    module = build_model(resolve(common_pb2.ModelSpec(config_json=json.dumps(raw)), "cpu"), "cpu")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, positions = torch.tensor(prompt_of(20)), torch.arange(20)
    for tensor in (ids, positions):
        torch._dynamo.mark_dynamic(tensor, 0)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(module, fullgraph=True, backend=backend)(ids, positions)
        torch.testing.assert_close(out, module(ids, positions))
    assert len(graphs) == 1
    op = torch.ops.kiln.attention
    calls = [n for n in graphs[0].graph.nodes if n.target in (op, op.default)]
    assert [(n.args[5], n.args[6]) for n in calls] == _expected_layers(module.config)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_dummy_weights_are_transformers_initialisation(model_type):
    """build_model's dummy weights, made on the meta device and initialised once by transformers' ``_init_weights``,
    against ``from_config``'s (built on the device, initialised twice): the same tensors, the same ties, every buffer
    (rotary frequencies, embedding scales) and every constant parameter (norms, biases) equal, every random one drawn
    from the same distribution; and reproducible from its seed."""
    from kiln.model.causal_lm import transformers_model
    from kiln.model.spec import resolve

    raw = dict(TINY, **FAMILY_CONFIGS[model_type])
    resolved = resolve(common_pb2.ModelSpec(config_json=json.dumps(raw)), "cpu")
    ours = transformers_model(resolved, "cpu", seed=3)
    theirs = tiny_model(model_type, seed=3)
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])

    def ties(model) -> set[frozenset[str]]:
        shared: dict[int, set[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            shared.setdefault(param.data_ptr(), set()).add(name)
        return {frozenset(names) for names in shared.values() if len(names) > 1}

    assert ties(ours) == ties(theirs)
    for (name, buffer), (_, expected) in zip(ours.named_buffers(), theirs.named_buffers(), strict=True):
        torch.testing.assert_close(buffer, expected, rtol=0, atol=0, msg=name)
    expected_params = dict(theirs.named_parameters())
    assert [n for n, _ in ours.named_parameters()] == list(expected_params)
    for name, param in ours.named_parameters():
        expected = expected_params[name]
        assert param.shape == expected.shape and param.dtype == expected.dtype, name
        if expected.numel() == 1 or bool((expected == expected.flatten()[0]).all()):
            torch.testing.assert_close(param, expected, rtol=0, atol=0, msg=name)
        else:
            assert param.std().item() == pytest.approx(expected.std().item(), rel=0.25), name
            assert abs(param.mean().item()) < 3 * expected.std().item() / param.numel() ** 0.5 + 1e-6, name
    again = transformers_model(resolved, "cpu", seed=3).state_dict()
    other = transformers_model(resolved, "cpu", seed=4).state_dict()
    assert all(torch.equal(t, again[n]) for n, t in ours.state_dict().items())
    assert not all(torch.equal(t, other[n]) for n, t in ours.state_dict().items())
