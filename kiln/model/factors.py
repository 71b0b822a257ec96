"""The model config as a key factor: exactly the fields that building and running the forward read.

A field no forward reads (token ids, ``initializer_range``, ``use_cache``) cannot change the generated code, so it is
not a factor; a field the forward does read is, whatever architecture family brought it. The reads are recorded, not
listed by hand: the model is built on the meta device from a copy of the config that records every attribute read,
and run once. HF's own aliases (``rope_theta`` vs ``rope_parameters``, a default ``head_dim``) are resolved by the
config before anything is read, so they key alike.
"""

import copy
import functools
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kiln.attention.op import ATTENTION_IMPLEMENTATION
from kiln.model.causal_lm import CONFIG_BUILD_ERRORS, TokenModel, unbuildable
from kiln.model.spec import ResolvedModel
from kiln.quantization.model_quantization import quantization_of

# Fields the build or the forward read that still cannot change the compiled code, and why.
NOT_CODE_FIELDS = {
    "name_or_path": "where the config was loaded from",
    "pad_token_id": "only the embedding's padding_idx, which changes gradients, never the forward",
    "tie_word_embeddings": "ties the head to the embedding; the compiled forward ends before the head",
    "attention_dropout": "dropout is off in eval mode and Kiln's attention op takes none",
    "output_attentions": "an output option; the compiled forward returns the last hidden state only",
    "output_hidden_states": "an output option; the compiled forward returns the last hidden state only",
    "return_dict": "the forward is called with return_dict=True",
    "use_cache": "the forward is called with use_cache=False",
    "dtype": "the model's dtype is a factor of its own, from the request",
    "torch_dtype": "the model's dtype is a factor of its own, from the request",
    "quantization_config": "a factor by what of it changes the code (model_config_factors), not its every field",
}


def model_config_factors(model: ResolvedModel) -> dict:
    """``model_type`` and every config field the forward reads, with its value, sorted by name; for an FP8
    checkpoint's config, what of its quantization changes the compiled code."""
    factors = json.loads(_factors_json(json.dumps(model.config.to_dict(), sort_keys=True, default=str), model.dtype))
    stored = quantization_of(model.config)
    if stored is not None:
        factors["quantization_config"] = stored.code_factors()
    return factors


@functools.lru_cache(maxsize=64)
def _factors_json(config_json: str, dtype: torch.dtype) -> str:
    """Cached by the config's own JSON: a meta build of an 8B model takes ~0.4 s, and a server keys often."""
    raw = json.loads(config_json)
    fields = {name: raw[name] for name in read_fields(config_json, dtype)
              if name in raw and not name.startswith("_") and name not in NOT_CODE_FIELDS}
    return json.dumps({"model_type": raw["model_type"], **fields}, sort_keys=True)


def read_fields(config_json: str, dtype: torch.dtype) -> set[str]:
    """Names read from the config while building the model on the meta device and running one forward."""
    raw = json.loads(config_json)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    reads: set[str] = set()
    config = copy.deepcopy(config)
    config.__class__ = _recording_class(type(config), reads)
    try:
        with torch.device("meta"):
            causal_lm = model_class(config).to(dtype)
        causal_lm.config._attn_implementation = ATTENTION_IMPLEMENTATION
        with torch.no_grad():
            TokenModel(causal_lm.eval())(torch.zeros(2, dtype=torch.long, device="meta"),
                                         torch.arange(2, device="meta"))
    except CONFIG_BUILD_ERRORS as exc:
        raise unbuildable(exc) from None
    return reads


def _recording_class(config_class: type, reads: set[str]) -> type:
    """A subclass of the config's class whose instances add every attribute name read to ``reads``."""

    def __getattribute__(self, name):
        reads.add(name)
        return config_class.__getattribute__(self, name)

    return type(config_class.__name__, (config_class,), {"__getattribute__": __getattribute__})
