"""Paged attention in plain torch: the CPU implementation and the reference the GPU kernels are tested against.

Each layer may have its own sliding window (``window`` > 0: a query attends to itself and the ``window - 1``
tokens before it, as transformers' sliding-window mask does) and its own soft-capping of the attention logits
(``softcap`` > 0: ``softcap * tanh(logits / softcap)`` before the softmax, as Gemma 2 does).

An FP8 cache (float8_e4m3fn) stores each key and value divided by its kv head's scale (``kv_scale`` [2, Hkv]: keys'
scales, values'), clamped to the format's range, and multiplies it back as it is read.
"""

import torch
import torch.nn.functional as F

from kiln.attention.forward_context import AttentionMetadata

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Store this step's keys and values at their slots; slots < 0 are padding and skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for i, x in enumerate((k, v)):
        x = x[valid]
        if kv_scale is not None:
            x = (x.float() / kv_scale[i][:, None]).clamp(-FP8_MAX, FP8_MAX)
        kv_cache[i].view(-1, num_kv_heads, head_dim)[slots] = x.to(kv_cache.dtype)


def read_kv(stored: torch.Tensor, kv_scale: torch.Tensor | None, which: int, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys (``which`` 0) or values (1) [T, Hkv, D] in ``dtype``, their FP8 scales multiplied back."""
    if kv_scale is None:
        return stored.to(dtype)
    return (stored.float() * kv_scale[which][:, None]).to(dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int = 0, window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of q [Tq, Hq, D] over k/v [Tk, Hkv, D]; query i sits at context position offset + i."""
    num_q, num_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    pos_q = torch.arange(num_q, device=q.device)[:, None] + offset
    pos_k = torch.arange(num_k, device=q.device)[None, :]
    mask = pos_k <= pos_q
    if window > 0:
        mask &= pos_k > pos_q - window
    q, k, v = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    if softcap > 0:
        # SDPA has no soft-capping: the eager form transformers' Gemma 2 uses, softmax in float32.
        logits = torch.matmul(q, k.transpose(1, 2)) * scale
        logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int = 0, softcap: float = 0.0, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k/v into the cache, then attend each sequence's queries over its cached context.

    With a window, only the blocks from the one holding the first query's earliest visible token on are read: the
    blocks before it may have been freed (their table entries then name the null block, see BlockManager).
    """
    write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
    out = torch.zeros_like(q)
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_seqs):
        lo, hi, seq_len = starts[i], starts[i + 1], seq_lens[i]
        first_query = seq_len - (hi - lo)
        first_block = max(0, first_query - window + 1) // block_size if window > 0 else 0
        key_start = first_block * block_size
        blocks = meta.block_tables[i, first_block:-(-seq_len // block_size)].long()
        keys, values = (read_kv(kv_cache[i][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len - key_start],
                                kv_scale, i, q.dtype) for i in (0, 1))
        out[lo:hi] = causal_attention(q[lo:hi], keys, values, scale, first_query - key_start, window, softcap)
    return out
