"""Plain-torch references for FP8 tests: a model whose FP8 linears are their dequantized weights, activations
quantized and dequantized per token in float32, and FP8 checkpoints written by the libraries that define them."""

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0


def fake_quantized(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` rounded to float8_e4m3fn with a scale per token (or the static one), back in float32."""
    x = x.float()
    scale = input_scale.float() if input_scale is not None else \
        (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


class DequantizedLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias, self.input_scale = weight.float(), bias, input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fake_quantized(x, self.input_scale) @ self.weight.T
        return (out if self.bias is None else out + self.bias.float()).to(x.dtype)


@torch.no_grad()  # the slices of merged weights and biases stay leaves: the judge deep-copies the reference
def dequantized_reference(token_model) -> torch.nn.Module:
    """transformers' model with Kiln's weights, each FP8 linear (the head's too, when it is one) replaced by its
    dequantized plain-torch form."""
    from kiln.quantization.fp8_linear import Fp8Linear

    causal_lm = copy.deepcopy(token_model.causal_lm)
    head = causal_lm.get_output_embeddings()
    if isinstance(head, Fp8Linear):
        causal_lm.set_output_embeddings(DequantizedLinear(head.dequantized(), head.bias, None))
    for layer in causal_lm.base_model.layers:
        layer.__dict__.pop("forward", None)  # Kiln's router: the reference runs transformers' own forward
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Fp8Linear):
                    rows = slice(child.start, child.end)
                    bias = None if child.bias is None else child.bias[rows]
                    setattr(parent, name, DequantizedLinear(child.dequantized(), bias, child.input_scale))
    causal_lm.config._attn_implementation = "sdpa"  # the copy's own config, shared by its modules
    return causal_lm.eval()


def tiny_model(path: Path, dtype=torch.float32, **fields):
    """A tiny Llama with seeded random weights, saved by transformers; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  max_position_embeddings=512, tie_word_embeddings=False, **fields)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # weights of a trained model's scale, so that quantization matters
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return model


def compressed_tensors_checkpoint(path: Path, scheme: str) -> None:
    """A tiny model quantized with compressed-tensors' preset ``scheme`` (FP8_DYNAMIC: per-channel weights, dynamic
    per-token activations; FP8: per-tensor weights and static activations), compressed and saved by the package."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_model(path)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]))
    for module in model.modules():
        args = getattr(module, "quantization_scheme", None)
        if args is None:
            continue
        w = module.weight.float()
        if args.weights.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        scale, _ = calculate_qparams(low, high, args.weights)  # what llm-compressor's min-max observer computes
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(0.02)  # a calibrated static scale
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def transformers_fp8_checkpoint(path: Path, block: tuple[int, int] = (32, 32)) -> None:
    """A tiny model in transformers' ``fp8`` format (float8 weight + weight_scale_inv per block), quantized by
    transformers' own quantize op. Its quantizer needs a GPU and accelerate, so the op it runs is called directly and
    the files are written as save_pretrained writes them."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    tiny_model(path)
    config = FineGrainedFP8Config(weight_block_size=block)
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": config})())
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            out.update(quantize._quantize_one(name, tensor))
        else:
            out[name] = tensor
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(raw))


def edit_checkpoint(path: Path, edit) -> None:
    """Rewrite the directory's model.safetensors with ``edit(tensors)`` applied."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
