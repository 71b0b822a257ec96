"""Kiln's attention op: a custom op that Dynamo cannot see into, so the compiled graph splits at it.

HF models reach it through transformers' AttentionInterface under the name ``kiln``; the paged KV cache and
the step's metadata come from the forward context. Without a context (a plain call outside the engine) the
tokens are one causal sequence, which is what the compile service's traces and checks use.
"""

import torch
from transformers import AttentionInterface

from kiln import attention_reference
from kiln.forward_context import current_forward_context

ATTENTION_IMPLEMENTATION = "kiln"
ATTENTION_OP_NAME = "kiln::attention"


@torch.library.custom_op(ATTENTION_OP_NAME, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the flattened tokens of a step -> [T, Hq, D]."""
    ctx = current_forward_context()
    if ctx is None:
        return attention_reference.causal_attention(q, k, v, scale).contiguous()
    kv_cache = ctx.kv_caches[layer_idx]
    if q.is_cuda:
        from kiln import attention_triton

        return attention_triton.paged_attention(q, k, v, kv_cache, ctx.metadata, scale)
    return attention_reference.paged_attention(q, k, v, kv_cache, ctx.metadata, scale)


@attention.register_fake
def _(q, k, v, layer_idx, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface adapter: HF passes [1, H, T, D]; Kiln's op works on [T, H, D]."""
    out = torch.ops.kiln.attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), module.layer_idx, float(scaling)
    )
    return out.unsqueeze(0), None


# No mask function is registered for "kiln": HF then builds no mask, the op knows each token's sequence.
AttentionInterface.register(ATTENTION_IMPLEMENTATION, _hf_attention)
