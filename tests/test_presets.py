"""The embedded presets are the real models' configs: each is honoured on CUDA, builds (on the meta device) to the
parameter count its hub page publishes, and carries the features that set it apart."""

import pytest
import torch

from kiln.model.presets import PRESETS
from kiln.model.spec import resolve
from protos import common_pb2

# Parameter counts as published for each checkpoint (embeddings included, tied ones once).
PARAMETERS = {
    "tiny-llama": 139_584,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b-v0.1": 7_241_732_096,
    "mistral-7b-v0.3": 7_248_023_552,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
}


def test_every_preset_has_its_count():
    assert set(PRESETS) == set(PARAMETERS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_honoured_and_has_the_published_size(name):
    from transformers import AutoModelForCausalLM

    config = resolve(common_pb2.ModelSpec(preset=name), "cuda").config  # refused features would raise here
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]


def test_presets_carry_their_attention_features():
    def config(name):
        return resolve(common_pb2.ModelSpec(preset=name), "cpu").config

    assert config("mistral-7b-v0.1").sliding_window == 4096 and config("mistral-7b-v0.3").sliding_window is None
    gemma = config("gemma-2-9b")
    assert gemma.layer_types[:2] == ["sliding_attention", "full_attention"] and gemma.sliding_window == 4096
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (50.0, 30.0)
    phi = config("phi-3-mini")
    assert phi.sliding_window == 2047 and phi.hidden_size // phi.num_attention_heads == 96
    assert set(config("qwen2.5-7b").layer_types) == {"full_attention"}  # use_sliding_window false
    assert config("llama-3.1-8b").rope_parameters["rope_type"] == "llama3"
