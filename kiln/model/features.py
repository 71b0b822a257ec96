"""Honour or refuse: for each supported family, what Kiln does with every config field that changes the forward.

A served model that quietly computes something else is the worst failure a serving system has. So every field of a
family's transformers config class is classified here, once: *honoured* (transformers' own modules compute it and
Kiln's attention op applies what reaches it), *conditional* (honoured for some values; a check names why another
value is refused) or *neutral* (it does not change an eval-mode forward without a cache). ``check`` runs at Compile
and at LoadModel, before anything is built, and refuses with INVALID_ARGUMENT naming the field.
``tests/test_model_features.py`` walks each family's config class and its modeling code and fails on a field
in none of the three.
"""

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields

from transformers import PretrainedConfig

from kiln.errors import InvalidArgument, quote
from kiln.quantization.model_quantization import check_supported, quantization_of

# (config, device) -> why this value is refused, or None when Kiln honours it.
Check = Callable[[PretrainedConfig, str], str | None]

# Rope types whose frequencies are fixed at init. "dynamic" and "longrope" recompute them from the longest position
# in the step, which in a batch of several sequences is another sequence's length: refused.
HONOURED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Kiln's attention op takes each layer's window: local (sliding) and global layers may alternate.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

# PretrainedConfig's own fields and the generation/training settings every family shares: none changes the logits
# of an eval-mode forward (dropout is off in eval; the token ids are the client's to send).
NEUTRAL = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "output_attentions",
    "use_cache", "initializer_range", "pad_token_id", "bos_token_id", "attention_dropout",
    "_attn_implementation",  # Kiln sets it to its own op
})

# Shapes and math every family computes through transformers' modules, whatever the value.
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "eos_token_id",  # the engine stops on it
    "default_theta",  # the class's rope base when a config gives none, folded into rope_parameters
})


# Keys that make transformers choose code: an attention or experts implementation may name a Hub kernel that the
# ``kernels`` package fetches and imports, ``auto_map`` a remote module. Kiln's attention op is the implementation, set
# by Kiln; a config that gives any of these a value (at any depth: a sub-config's too; null chooses nothing) is
# refused before it is built.
CODE_FIELDS = frozenset({"auto_map", "trust_remote_code", "custom_pipelines", "kernel_config", "use_kernels"})


def selects_code(name: str) -> bool:
    return name in CODE_FIELDS or name.strip("_").removesuffix("_internal").endswith("implementation")


def check_raw(raw: dict) -> None:
    """INVALID_ARGUMENT naming the first key of a raw config.json that would choose code rather than describe the
    model; run before transformers sees the config."""
    pending = [("", raw)]
    while pending:
        prefix, item = pending.pop()
        for name, value in item.items():
            if selects_code(str(name)) and value is not None:
                raise InvalidArgument(f"model config {prefix}{name}: chooses code to run (an implementation, a kernel "
                                      f"or a remote module); Kiln runs its own attention op and no other code, "
                                      f"remove the field")
            if isinstance(value, dict):
                pending.append((f"{prefix}{name}.", value))


MAX_CUDA_HEAD_DIM = 256  # the Triton kernels hold a tile of one head and its fp32 accumulator in registers


def _rope_types(config: PretrainedConfig) -> dict[str, str]:
    """rope_type by layer type ("" for a config with one rope for every layer)."""
    params = config.rope_parameters or {}
    if all(isinstance(v, dict) for v in params.values()) and params:
        return {layer: p.get("rope_type", "default") for layer, p in params.items()}
    return {"": params.get("rope_type", "default")}


def _rope(config: PretrainedConfig, device: str) -> str | None:
    for layer, rope_type in _rope_types(config).items():
        if rope_type not in HONOURED_ROPE_TYPES:
            where = f"[{layer!r}]" if layer else ""
            return (f"rope_type {rope_type!r}{where} is not implemented (its frequencies depend on the longest "
                    f"sequence in a batch, or Kiln has no test for it); honoured: {', '.join(HONOURED_ROPE_TYPES)}")
    return None


def _layer_types(config: PretrainedConfig, device: str) -> str | None:
    unknown = sorted({t for t in config.layer_types or () if t not in ATTENTION_LAYER_TYPES})
    if unknown:
        return (f"layer types {', '.join(map(repr, unknown))} are not implemented; "
                f"honoured: {', '.join(ATTENTION_LAYER_TYPES)}")
    return None


def _sliding_window(config: PretrainedConfig, device: str) -> str | None:
    window = config.sliding_window
    if window is not None and (not isinstance(window, int) or window < 1):
        return "a sliding window is a number of tokens, at least 1 (null for none)"
    return None


def _causal(config: PretrainedConfig, device: str) -> str | None:
    if config.use_bidirectional_attention:
        return "bidirectional attention (an embedding model's) is not implemented; Kiln serves causal decoders"
    return None


def _no_attention_softcap(config: PretrainedConfig, device: str) -> str | None:
    if config.attn_logit_softcapping is not None:
        return ("transformers' Gemma 3 stores this cap but never applies it; Kiln refuses it rather than guess "
                "which of the two you meant (Gemma 3 checkpoints set it to null)")
    return None


def _quantization(config: PretrainedConfig, device: str) -> str | None:
    """FP8 checkpoints (compressed-tensors, transformers' fp8) are honoured; any other method or scheme is refused
    naming the field and its value, and so is FP8 on a device that cannot run it."""
    try:
        check_supported(quantization_of(config), device, "model config quantization_config")
    except InvalidArgument as exc:
        raise InvalidArgument(f"{exc} (model_type {config.model_type!r})") from None
    return None


def _head_dim(config: PretrainedConfig, device: str) -> str | None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if device == "cuda" and head_dim > MAX_CUDA_HEAD_DIM:
        return f"head_dim {head_dim} is more than the CUDA attention kernels' {MAX_CUDA_HEAD_DIM}"
    return None


@dataclass(frozen=True)
class Family:
    """One model_type: the fields of its config class beyond the shared ones, each honoured, conditional or neutral."""

    model_type: str
    title: str
    honoured: frozenset[str] = frozenset()
    conditional: Mapping[str, Check] = field(default_factory=dict)
    neutral: frozenset[str] = frozenset()

    def honours(self, name: str) -> bool:
        return name in HONOURED or name in self.honoured

    def is_neutral(self, name: str) -> bool:
        return name in NEUTRAL or name in self.neutral

    def checks(self) -> dict[str, Check]:
        return {"rope_parameters": _rope, "head_dim": _head_dim, "quantization_config": _quantization,
                **self.conditional}

    def classified(self) -> set[str]:
        return set(HONOURED | self.honoured | NEUTRAL | self.neutral | self.checks().keys())


# Sliding-window layers: the window, and the layer types that say which layers are local.
_WINDOWED = {"sliding_window": _sliding_window, "layer_types": _layer_types}
# Qwen's switch and the first local layer: honoured through the layer types they set.
_QWEN_WINDOWS = frozenset({"use_sliding_window", "max_window_layers"})
# Gemma: the MLP's activation, the attention scale (query_pre_attn_scalar ** -0.5), the final logits' cap (applied by
# kiln.model.causal_lm.FINAL_LOGITS).
_GEMMA = frozenset({"attention_bias", "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping"})
_DROPOUTS = frozenset({"resid_pdrop", "embd_pdrop", "residual_dropout", "embedding_dropout"})  # off in eval

FAMILIES: dict[str, Family] = {f.model_type: f for f in [
    Family("llama", "Llama", honoured=frozenset({"attention_bias", "mlp_bias"}),
           neutral=frozenset({"pretraining_tp"})),  # declared, but transformers 5's Llama never reads it
    Family("mistral", "Mistral", conditional={"sliding_window": _sliding_window}),
    Family("qwen2", "Qwen2", honoured=_QWEN_WINDOWS, conditional=_WINDOWED),
    Family("qwen3", "Qwen3", honoured=_QWEN_WINDOWS | {"attention_bias"}, conditional=_WINDOWED),
    Family("gemma", "Gemma", honoured=frozenset({"attention_bias"}),
           conditional={"use_bidirectional_attention": _causal}),
    Family("gemma2", "Gemma 2", honoured=_GEMMA | {"attn_logit_softcapping"},  # the op's softcap
           conditional={**_WINDOWED, "use_bidirectional_attention": _causal}),
    Family("gemma3_text", "Gemma 3 (text)", honoured=_GEMMA,
           # read by the image-text classes in the same module only, never on Gemma3ForCausalLM's path
           neutral=frozenset({"image_token_id", "mm_tokens_per_image", "text_config", "vision_config"}),
           conditional={**_WINDOWED, "use_bidirectional_attention": _causal,
                        "attn_logit_softcapping": _no_attention_softcap}),
    Family("phi3", "Phi-3", honoured=frozenset({"original_max_position_embeddings"}), neutral=_DROPOUTS,
           conditional={"sliding_window": _sliding_window}),
    Family("olmo2", "OLMo 2", honoured=frozenset({"attention_bias"})),
    Family("olmo3", "OLMo 3", honoured=frozenset({"attention_bias"}), conditional=_WINDOWED),
    Family("granite", "Granite", honoured=frozenset({  # logits_scaling by kiln.model.causal_lm.FINAL_LOGITS
        "attention_bias", "mlp_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
        "logits_scaling"})),
    Family("starcoder2", "StarCoder2", honoured=frozenset({"norm_epsilon", "use_bias"}), neutral=_DROPOUTS,
           conditional={"sliding_window": _sliding_window}),
    Family("cohere2", "Cohere 2", honoured=frozenset({"layer_norm_eps", "attention_bias", "logit_scale"}),
           conditional=_WINDOWED),
    Family("ministral", "Ministral", conditional=_WINDOWED),
    Family("smollm3", "SmolLM3", honoured=frozenset({  # rope-less layers, and the switch for local ones
        "attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval", "use_sliding_window"}),
           conditional=_WINDOWED),
    Family("exaone4", "EXAONE 4", honoured=frozenset({"sliding_window_pattern"}), conditional=_WINDOWED),
    Family("helium", "Helium", honoured=frozenset({"attention_bias", "mlp_bias"})),
    Family("glm4", "GLM-4", honoured=frozenset({"attention_bias"})),
]}


def declared_fields(config_class: type[PretrainedConfig]) -> set[str]:
    return {f.name for f in fields(config_class)}


def check(config: PretrainedConfig, device: str, families: Mapping[str, Family] = FAMILIES) -> None:
    """Raise InvalidArgument naming the first field whose value Kiln would not compute as transformers does."""
    family = families[config.model_type]
    declared = declared_fields(type(config))
    defaults = {f.name: f.default for f in fields(type(config)) if f.default is not MISSING}
    values = config.to_dict()
    for name in sorted(declared | values.keys()):
        if name.startswith("_") or name == "model_type":
            continue
        reason = None
        if name in family.checks():
            reason = family.checks()[name](config, device)
        elif family.honours(name) or family.is_neutral(name):
            continue
        elif name in declared and getattr(config, name, None) != defaults.get(name):
            # A field this transformers version has and Kiln has not reviewed: only its default is known to be safe.
            reason = f"Kiln has not reviewed this {family.title} field; only its default is served"
        if reason:
            raise InvalidArgument(f"model config {name}={quote(getattr(config, name, None))}: {reason} "
                                  f"(model_type {config.model_type!r})")


def is_mixture_of_experts(model_type: object) -> bool:
    """Whether transformers knows ``model_type`` as a model whose config routes tokens to experts."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return False
    return any("expert" in name for name in declared_fields(CONFIG_MAPPING[model_type]))
