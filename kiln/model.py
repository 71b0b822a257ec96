"""Builds an HF causal LM on the target device and wraps it as the token-flat module Kiln compiles."""

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import kiln.attention  # noqa: F401  (registers the "kiln" attention implementation)
from kiln.attention import ATTENTION_IMPLEMENTATION
from kiln.errors import InvalidArgument, NotFound, quote
from kiln.model_spec import ResolvedModel


def _softcapped(config, logits: torch.Tensor) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


# What a family's ForCausalLM does to lm_head's output in its forward. Kiln takes logits itself, on the rows that
# need them only, so it applies the same here (in the model's dtype, as transformers does); kiln.model_features
# lists these fields as honoured.
FINAL_LOGITS = {
    "gemma2": _softcapped,
    "gemma3_text": _softcapped,
    "granite": lambda config, logits: logits / config.logits_scaling,
    "cohere2": lambda config, logits: logits * config.logit_scale,
}


class TokenModel(torch.nn.Module):
    """Flattened tokens of every sequence in a step -> final hidden states, one row per token.

    This is what gets compiled: the weights are attributes of the module, so they are arguments of the compiled
    code, never constants in it. Logits are taken by ``logits`` on the rows that need them only.
    """

    def __init__(self, causal_lm: PreTrainedModel):
        super().__init__()
        self.causal_lm = causal_lm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.causal_lm.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
        )
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.causal_lm.get_output_embeddings()(hidden)
        final = FINAL_LOGITS.get(self.config.model_type)
        return (final(self.config, logits) if final else logits).float()

    @property
    def config(self):
        return self.causal_lm.config


def build_model(model: ResolvedModel, device: str, weights: str = "dummy", seed: int = 0) -> TokenModel:
    """The model with dummy weights (seeded) or the safetensors of a local HF directory, in eval mode."""
    if weights in ("", "dummy"):
        torch.manual_seed(seed)
        with torch.device(device):
            causal_lm = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    else:
        causal_lm = _load_pretrained(weights, model, device)
    causal_lm.config._attn_implementation = ATTENTION_IMPLEMENTATION
    return TokenModel(causal_lm.eval()).eval()


def _load_pretrained(weights: str, model: ResolvedModel, device: str) -> PreTrainedModel:
    from pathlib import Path

    path = Path(weights)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise NotFound(f"weights: {quote(weights)} is neither 'dummy' nor a directory with *.safetensors")
    try:
        # Moved after loading: device_map would need accelerate, which Kiln does not depend on.
        return AutoModelForCausalLM.from_pretrained(
            path, config=model.config, dtype=model.dtype, use_safetensors=True
        ).to(device)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"weights: cannot load {quote(weights)}: {quote(str(exc))}") from None


def weights_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
