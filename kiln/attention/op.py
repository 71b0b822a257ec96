"""Kiln's attention op: a custom op that Dynamo cannot see into, so the compiled graph splits at it.

HF models reach it through transformers' AttentionInterface under the name ``kiln``; the paged KV cache and
the step's metadata come from the forward context. Without a context (a plain call outside the engine) the
tokens are one causal sequence, which is what the compile service's traces and checks use.

A layer's sliding window and attention-logit soft-cap are arguments of its call: constants of the traced graph,
one per kind of layer, so local and global layers differ and a captured CUDA graph replays each layer with its own.
The layer index is not a constant but a tensor input (``kiln_layer``, passed down by
``kiln.model.causal_lm.LayerStep``), so one compiled decoder layer serves every layer of its kind.
"""

import torch
from transformers import AttentionInterface

from kiln.attention import reference as attention_reference
from kiln.attention.forward_context import current_forward_context
from kiln.attention.rotary import rotate
from kiln.dispatcher_op import dispatcher_op

ATTENTION_IMPLEMENTATION = "kiln"
ATTENTION_OP_NAME = "kiln::attention"

# Keyword arguments transformers' decoder layers pass down that do not change their output here: positions are in
# the rotary tables, the cache is Kiln's. Attention modules add the tables themselves (already in q and k) and
# dropout (off in eval).
LAYER_NEUTRAL_KWARGS = frozenset({"position_ids", "use_cache", "cache", "past_key_values", "cache_position",
                                  "output_attentions"})
_ATTENTION_NEUTRAL_KWARGS = LAYER_NEUTRAL_KWARGS | {"position_embeddings", "dropout"}


def asked_of(kwargs: dict, neutral: frozenset[str]) -> list[str]:
    """The keyword arguments that ask for something (set, and not to None or False) beyond the ``neutral`` ones."""
    return sorted(k for k, v in kwargs.items() if k not in neutral and v is not None and v is not False)


def _fake(q, k, v, layer, scale, window=0, softcap=0.0, cos=None, sin=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@dispatcher_op(ATTENTION_OP_NAME, "(Tensor q, Tensor k, Tensor v, Tensor layer, float scale, int window=0, "
               "float softcap=0.0, Tensor? cos=None, Tensor? sin=None) -> Tensor", _fake)
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float, window: int = 0,
    softcap: float = 0.0, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the flattened tokens of a step -> [T, Hq, D].

    ``layer`` is the layer's index as a 0-d CPU tensor: read without a device sync, and at CUDA-graph capture time.
    ``window`` > 0 limits each query to itself and the ``window - 1`` tokens before it; ``softcap`` > 0 caps the
    logits at ``softcap * tanh(logits / softcap)``. With the rotary tables ``cos``/``sin`` [T, D] (the compile's pass
    kiln.attention.rotary.route_rotary), q and k come unrotated and the op rotates them first.
    """
    ctx = current_forward_context()
    rotary = None if cos is None else (cos, sin)
    if rotary is not None and not (q.is_cuda and ctx is not None):  # on CUDA in a step the KV write's kernel does
        q, k, rotary = rotate(q, cos, sin), rotate(k, cos, sin), None
    if ctx is None:
        return attention_reference.causal_attention(q, k, v, scale, 0, window, softcap).contiguous()
    kv_cache = ctx.kv_caches[int(layer)]
    kv_scale = ctx.kv_scales[int(layer)] if ctx.kv_scales is not None else None
    if q.is_cuda:
        from kiln.attention import triton_kernels as attention_triton

        return attention_triton.paged_attention(q, k, v, kv_cache, ctx.metadata, scale, window, softcap, kv_scale,
                                                rotary)
    return attention_reference.paged_attention(q, k, v, kv_cache, ctx.metadata, scale, window, softcap, kv_scale)


def _hf_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, *,
                  kiln_layer: torch.Tensor, **kwargs):
    """AttentionInterface adapter: HF passes [1, H, T, D]; Kiln's op works on [T, H, D]. ``kiln_layer`` is the
    layer index tensor that
    ``kiln.model.causal_lm.LayerStep`` passes down through the decoder layer's keyword arguments.

    Anything else a module asks of attention (a non-causal mask, attention sinks, ...) is refused here rather than
    ignored; kiln.model.features refuses the configs that lead to it before a model is built.
    """
    asked = asked_of(kwargs, _ATTENTION_NEUTRAL_KWARGS)
    if asked or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"Kiln's attention op does not implement {asked or ['non-causal attention']} "
                                  f"({type(module).__name__})")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.kiln.attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), kiln_layer, scale,
        int(sliding_window or 0), float(softcap or 0.0),
    )
    return out.unsqueeze(0), None


# No mask function is registered for "kiln": HF then builds no mask, the op knows each token's sequence.
AttentionInterface.register(ATTENTION_IMPLEMENTATION, _hf_attention)
