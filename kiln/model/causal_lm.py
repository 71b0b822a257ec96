"""Builds an HF causal LM on the target device and wraps it as the token-flat module Kiln compiles, layer by layer.

Before a byte is allocated the model is built on the meta device: a config transformers cannot build is the
caller's INVALID_ARGUMENT, weights larger than the device's free memory are RESOURCE_EXHAUSTED, and a checkpoint
is checked tensor by tensor against it (kiln.model.checkpoint).
"""

import inspect
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, PreTrainedModel

import kiln.attention.op  # noqa: F401  (registers the "kiln" attention implementation)
from kiln.attention.op import ATTENTION_IMPLEMENTATION
from kiln.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted, first_line, quote
from kiln.model import checkpoint
from kiln.model.device_memory import available_bytes
from kiln.model.layer_regions import DecoderLayers
from kiln.model.merged_projections import merge_projections
from kiln.model.spec import ResolvedModel
from kiln.model.tensor_parallel import TensorParallel, load_shard, shard_layers
from kiln.quantization import fp8_checkpoint
from kiln.quantization.checkpoint_formats import Fp8Checkpoint
from kiln.quantization.fp8_linear import Fp8Linear
from kiln.quantization.model_quantization import Fp8Quantization, check_head, quantization_of
from kiln.quantization.quantize_layers import quantize_head as quantize_model_head
from kiln.quantization.quantize_layers import quantize_layer

LayerHook = Callable[[torch.nn.Module, str], object]  # (decoder layer, its name in the model): makes it FP8


def _softcapped(config, logits: torch.Tensor) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


# What a family's ForCausalLM does to lm_head's output in its forward. Kiln takes logits itself, on the rows that
# need them only, so it applies the same here (in the model's dtype, as transformers does); kiln.model.features
# lists these fields as honoured.
FINAL_LOGITS = {
    "gemma2": _softcapped,
    "gemma3_text": _softcapped,
    "granite": lambda config, logits: logits / config.logits_scaling,
    "cohere2": lambda config, logits: logits * config.logit_scale,
}


class TokenModel(torch.nn.Module):
    """Flattened tokens of every sequence in a step -> final hidden states, one row per token.

    What gets compiled is one decoder layer per kind (``kiln.model.layer_regions``), run for every layer with that
    layer's weights as inputs, never constants; the rest of transformers' forward runs as written. Logits are taken
    by ``logits`` on the rows that need them only.
    """

    def __init__(self, causal_lm: PreTrainedModel, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.causal_lm = causal_lm
        base = causal_lm.base_model
        if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
            raise InvalidArgument(f"model config: {type(base).__name__} has no list of decoder layers to compile")
        layers = base.layers[:causal_lm.config.num_hidden_layers]
        merge_projections(layers)
        if tensor_parallel is not None and tensor_parallel.size > 1:
            shard_layers(layers, causal_lm.config, tensor_parallel)
        self.layers = DecoderLayers(layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with self.layers.running():  # each layer eagerly, unless a compiled forward routes them already
            out = self.causal_lm.base_model(
                input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                return_dict=True)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.causal_lm.get_output_embeddings()(hidden)
        final = FINAL_LOGITS.get(self.config.model_type)
        return (final(self.config, logits) if final else logits).float()

    @property
    def config(self):
        return self.causal_lm.config

    @property
    def is_fp8(self) -> bool:
        return any(isinstance(m, Fp8Linear) for step in self.layers.steps for m in step.layer.modules())


def build_model(model: ResolvedModel, device: str, weights: str = "dummy", seed: int = 0,
                quantization: str = "", tensor_parallel: TensorParallel | None = None,
                quantize_head: bool = False) -> TokenModel:
    """The model with dummy weights (seeded) or the safetensors of a local HF directory, in eval mode; its decoder
    linears in FP8 when ``quantization`` is "fp8" or the model's config is an FP8 checkpoint's
    (kiln.quantization.model_quantization), and with ``quantize_head`` its head too. With ``tensor_parallel`` over
    more than one rank, its decoder layers are that rank's shards (kiln.model.tensor_parallel): cut from dummy
    weights the same seed gives every rank, or read from the checkpoint slice by slice."""
    fp8 = quantization_of(model.config, quantization)
    check_head(fp8, quantize_head)
    sharded = tensor_parallel is not None and tensor_parallel.size > 1
    if sharded and fp8 is not None:
        raise InvalidArgument("tensor_parallel_size: over one rank, models are served in their own dtype only so "
                              "far (no FP8)")
    skeleton = _skeleton(model)
    _check_fits(skeleton, model, device, fp8, tensor_parallel.size if sharded else 1)
    if weights in ("", "dummy"):
        hook = _shard_layer(skeleton.config, tensor_parallel) if sharded else _fp8_layer(fp8)
        causal_lm = _dummy_weights(skeleton, device, seed, hook)
    else:
        directory = Path(weights)  # a directory the model roots admitted (exec_service.api.load_request)
        if not directory.is_dir():
            raise NotFound(f"weights: {quote(weights)} is neither 'dummy' nor a directory with *.safetensors")
        if fp8 is not None and fp8.checkpoint is not None:
            causal_lm = _load_fp8_checkpoint(directory, skeleton, fp8.checkpoint, device, seed)
        else:
            checkpoint.check(directory, skeleton)
            if sharded:
                return _load_sharded(directory, skeleton, device, seed, tensor_parallel)
            causal_lm = _load_pretrained(directory, model, device, _fp8_layer(fp8))
    if quantize_head:
        quantize_model_head(causal_lm)
    causal_lm.config._attn_implementation = ATTENTION_IMPLEMENTATION
    return TokenModel(causal_lm.eval(), tensor_parallel).eval()


# What transformers raises for a config it cannot build a model from: the caller's config, not Kiln's fault.
CONFIG_BUILD_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError, ZeroDivisionError)


def unbuildable(exc: Exception) -> InvalidArgument:
    return InvalidArgument(f"model config: transformers cannot build this model: {first_line(exc)}")


def _skeleton(model: ResolvedModel) -> PreTrainedModel:
    """The model on the meta device: its parameters' names, shapes and sizes, at no memory cost."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    except CONFIG_BUILD_ERRORS as exc:
        raise unbuildable(exc) from None


def transformers_model(model: ResolvedModel, device: str, seed: int = 0) -> PreTrainedModel:
    """transformers' own model with the dummy weights ``build_model`` gives for ``seed``, its projections apart (as
    checkpoints and transformers keep them): what references and saved copies of Kiln's model are made from."""
    return _dummy_weights(_skeleton(model), device, seed).eval()


def _dummy_weights(skeleton: PreTrainedModel, device: str, seed: int,
                   prepare_layer: LayerHook | None = None) -> PreTrainedModel:
    """The skeleton's tensors on ``device``, each initialised once by transformers' own ``_init_weights`` (seeded):
    the values transformers gives every tensor a checkpoint lacks (``from_pretrained`` builds on the meta device and
    initialises those this way), without building the model a second time and without the per-module torch
    initialisations that ``from_config`` runs first and then overwrites (12 of the 20 s of a 1B model on a CPU).

    With ``prepare_layer`` (FP8), each decoder layer is materialised, initialised and handed to it in turn, so that
    only one layer is ever in the model's dtype: the values are those of the whole model's initialisation, in the
    same order."""
    if prepare_layer is None:
        causal_lm = skeleton.to_empty(device=device)  # uninitialised storage; ties between parameters come undone
        torch.manual_seed(seed)
        causal_lm.init_weights()  # every module's _init_weights (rotary buffers included), then the ties again
        return causal_lm
    layers = _decoder_layers(skeleton)
    inside = {id(m) for layer in layers.values() for m in layer.modules()}
    for module in skeleton.modules():
        if id(module) not in inside:
            module.to_empty(device=device, recurse=False)
    torch.manual_seed(seed)
    prefixes = {id(layer): prefix for prefix, layer in layers.items()}
    # transformers 5.24 passes whether the model is remote code; earlier 5.x releases take the module alone.
    custom = (skeleton.is_custom_code(),) if "is_custom_code" in \
        inspect.signature(skeleton._initialize_weights).parameters else ()

    def initialise(module: torch.nn.Module, init) -> None:  # PreTrainedModel.initialize_weights' order: children first
        for child in module.children():
            if id(child) in prefixes:
                child.to_empty(device=device)
            initialise(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
            if id(child) in prefixes:
                prepare_layer(child, prefixes[id(child)])
        init(module, *custom)

    with torch.no_grad():
        initialise(skeleton, skeleton._initialize_weights)
    skeleton.tie_weights()
    return skeleton


def _decoder_layers(causal_lm: PreTrainedModel) -> dict[str, torch.nn.Module]:
    """Name -> module of each decoder layer Kiln runs (TokenModel's)."""
    layers = getattr(causal_lm.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise InvalidArgument(f"model config: {type(causal_lm.base_model).__name__} has no list of decoder layers "
                              f"to compile")
    names = {id(m): n for n, m in causal_lm.named_modules()}
    return {names[id(layer)]: layer for layer in layers[:causal_lm.config.num_hidden_layers]}


def _fp8_layer(fp8: Fp8Quantization | None) -> LayerHook | None:
    """What makes a decoder layer FP8 once its model-dtype weights are there: None when the model is not FP8."""
    if fp8 is None:
        return None
    fmt = fp8.checkpoint

    def prepare(layer: torch.nn.Module, prefix: str) -> None:
        quantize_layer(layer, prefix, fp8.static_activations, fmt.ignores if fmt else lambda name: False)

    return prepare


def _shard_layer(config, tensor_parallel: TensorParallel) -> LayerHook:
    """Each decoder layer cut to this rank's shard as soon as it is initialised whole: only one whole layer is ever
    on the device, and its values are those of the one-rank model (the same initialisation, in the same order)."""
    def prepare(layer: torch.nn.Module, prefix: str) -> None:
        merge_projections([layer])
        shard_layers([layer], config, tensor_parallel)

    return prepare


def _load_fp8_checkpoint(directory: Path, skeleton: PreTrainedModel, fmt: Fp8Checkpoint, device: str,
                         seed: int) -> PreTrainedModel:
    """An FP8 checkpoint, checked name by name, shape by shape, type by type and its scales value by value before
    anything is built, then loaded layer by layer (kiln.quantization.fp8_checkpoint); the rest of the model's
    tensors after."""
    linears = fp8_checkpoint.quantized_linears(_decoder_layers(skeleton), fmt)
    scales = fp8_checkpoint.expected_scales(linears, fmt)
    checkpoint.check(directory, skeleton, extra=scales)
    reader = fp8_checkpoint.CheckpointReader(directory)
    reader.check_fp8(linears)
    reader.check_scales(scales)
    causal_lm = _dummy_weights(skeleton, device, seed,
                               lambda layer, prefix: fp8_checkpoint.load_layer(layer, prefix, reader, fmt))
    inside = tuple(f"{prefix}." for prefix in _decoder_layers(causal_lm))
    with torch.no_grad():
        for name, tensor in causal_lm.state_dict(keep_vars=True).items():
            if not name.startswith(inside) and name in reader.files:
                tensor.copy_(reader.read(name))
    return causal_lm


def _load_sharded(directory: Path, skeleton: PreTrainedModel, device: str, seed: int,
                  tensor_parallel: TensorParallel) -> TokenModel:
    """This rank's shard of a checkpoint: the model merged and sharded on the meta device, its storage allocated at
    the shard's size, the decoder layers' tensors read as this rank's slices and the rest whole."""
    skeleton.config._attn_implementation = ATTENTION_IMPLEMENTATION
    token_model = TokenModel(skeleton.eval(), tensor_parallel)  # no bytes yet: every tensor is on the meta device
    causal_lm = skeleton.to_empty(device=device)
    torch.manual_seed(seed)
    causal_lm.init_weights()  # the rotary tables and the ties; every weight is read over below
    reader = fp8_checkpoint.CheckpointReader(directory)
    read = load_shard(_decoder_layers(causal_lm), reader.files, tensor_parallel)
    with torch.no_grad():
        for name, tensor in causal_lm.state_dict(keep_vars=True).items():
            if name in reader.files and name not in read:
                tensor.copy_(reader.read(name))
    return token_model.eval()


def _check_fits(skeleton: PreTrainedModel, model: ResolvedModel, device: str, fp8: Fp8Quantization | None,
                ranks: int = 1) -> None:
    needed, free = weights_bytes(skeleton), available_bytes(device)
    if fp8 is not None:  # a byte per weight of the decoder's linears, and a float32 scale per row
        for linear in _decoder_linears(skeleton):
            needed -= linear.weight.numel() * (linear.weight.element_size() - 1) - 4 * linear.out_features
    if ranks > 1:  # a shard of each decoder linear (the rest is replicated)
        needed -= sum(linear.weight.numel() * linear.weight.element_size()
                      for linear in _decoder_linears(skeleton)) * (ranks - 1) // ranks
    kind = f"{model.dtype_name}{' with FP8 linears' if fp8 else ''}"
    kind += f", one of {ranks} shards" if ranks > 1 else ""
    if free is not None and needed > free:
        raise ResourceExhausted(f"model config: the weights of {model.name} in {kind} take "
                                f"{needed / 2**30:.1f} GiB, the {device} has {free / 2**30:.1f} GiB free")


def _decoder_linears(skeleton: PreTrainedModel) -> list[torch.nn.Linear]:
    return [m for layer in _decoder_layers(skeleton).values() for m in layer.modules() if type(m) is torch.nn.Linear]


def _load_pretrained(path: Path, model: ResolvedModel, device: str,
                     prepare_layer: LayerHook | None = None) -> PreTrainedModel:
    try:
        # Moved after loading: device_map would need accelerate, which Kiln does not depend on.
        causal_lm = AutoModelForCausalLM.from_pretrained(path, config=model.config, dtype=model.dtype,
                                                         use_safetensors=True)
    except SafetensorError as exc:
        raise DataLoss(f"weights: a safetensors file in {path} is damaged ({first_line(exc)})") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"weights: cannot load {quote(str(path))}: {quote(first_line(exc))}") from None
    if prepare_layer is not None:  # each layer to the device and FP8 there, one at a time
        for prefix, layer in _decoder_layers(causal_lm).items():
            prepare_layer(layer.to(device), prefix)
    return causal_lm.to(device)


def weights_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
