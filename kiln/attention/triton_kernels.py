"""Paged attention on CUDA with Triton: the GPU implementation of Kiln's attention op.

Same semantics as ``kiln.attention.reference.paged_attention``, in three kernels:

- ``_write_kv_kernel`` stores the step's keys and values at their cache slots (padding slots < 0 are skipped).
- Decode (every sequence has one query token) is flash-decoding: a program owns one sequence, one kv head and one
  split of the context, attends all query heads of that kv head at once (K/V are read once per GQA group), and the
  splits are merged by their log-sum-exp: by the split of each (sequence, kv head) that ends last, on the counters
  the runner keeps (``AttentionMetadata.split_counters``), else by a second kernel. The grid depends only on tensor
  shapes and the device, and the kernels read sequence lengths and block tables on the device, so a decode step
  captured in a CUDA graph stays correct when it is replayed with other lengths and tables.
- Every other step (prefill, mixed prefill and decode, prefill over a cached prefix) runs one varlen
  flash-attention launch: the new tokens are written first, and each sequence's queries sit at the end of its
  context (causal); the cached prefix is read through the block table, the step's own tokens from its k/v where
  the cache holds them as they are (else from the cache too). In a mixed step the sequences with one query
  token go to the decode kernels instead: every kernel is launched over all the step's rows and takes the rows
  whose query length is its own, read on the device. So a step's grid depends on its row count and its longest
  query only, and a step captured at a token count (``AttentionMetadata.any_rows``: the longest query bounded by
  that count) stays correct replayed with any mix of prefills and decodes within it.

A layer's sliding window (``window`` > 0) and attention-logit soft-cap (``softcap`` > 0) are kernel arguments, the
same on every call of that layer, so a captured graph stays right: decode reads only the window's tail of the
context, prefill skips the tiles before every row's window and masks the ones a window edge crosses. No kernel
loads a position outside every query's window: the blocks there may have been freed (BlockManager), their table
entries naming the null block. A head_dim that is not a power of two (Phi-3's 96) is padded to one inside the
kernels, masked on load and store.

Accumulation is in fp32; fp32 inputs' dots are IEEE unless torch.set_float32_matmul_precision allows TF32, the
switch cuBLAS follows for the model's own matmuls. The output has q's dtype. Rows of the batch that are CUDA-graph
padding (sequence length 0) produce zeros.

An FP8 cache (``kv_scale`` given) is written divided by each kv head's scale: the key scale is folded into the
scores' scale, and each value tile is multiplied by its scale as it is read (``_online_softmax``).
"""


import torch
import triton
import triton.language as tl

from kiln import programmatic_launch
from kiln.attention.forward_context import AttentionMetadata
from kiln.model.features import MAX_CUDA_HEAD_DIM
from kiln.multiprocessors import sm_count
from kiln.programmatic_launch import release
from kiln.shared_memory import max_shared_bytes

LOG2E = 1.4426950408889634
MAX_DECODE_SPLITS = 64  # upper bound on the splits of one sequence's context in decode
MIN_SPLIT_TOKENS = 64  # a split reads at least this many context tokens, when the cache can hold that many
FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value: an FP8 cache's keys and values are clamped to it
# Decode: (context tokens per loop iteration, num_warps, num_stages) over a cache in the model's dtype, split (small
# batches) and at one split a sequence (from 4 x SMs / kv heads rows: Llama-3-8B's 66 on 132 SMs), and over an FP8
# cache, split and at one split. On an H100 64 tokens took bf16's decode 16-19% faster at 128 rows but 5-9% slower
# at 1 and 32, and a third stage took an FP8 cache's 1-9% faster at every size timed; over an FP8 cache 64 tokens in
# two stages took 128 x 1,024 from 154.9 to 117.0 µs on the H200 and from 154.0 to 120.3 on an H100, at 32 rows
# (several splits) no faster (BENCHMARKS.md, the decode kernels' tile; bench/attention_kernels.py --decode-tiles).
# Each tile is a kernel variant: the warm-up builds both of a cache's (one split over a narrow table, several over a
# wide one).
DECODE_TILE = (32, 4, 2)
DECODE_TILE_ONE_SPLIT = (64, 4, 2)
DECODE_TILE_FP8 = (32, 4, 3)
DECODE_TILE_FP8_ONE_SPLIT = (64, 4, 2)
DECODE_WAVES = 4  # decode aims at this many programs per multiprocessor
# Up to this many splits the last split of each (sequence, kv head) merges them; past it the reduce kernel does: the
# merge reads the splits one after another: at 17 (bs 1, a 1,040-token table, H200) 3.7 µs a layer more than the reduce.
MERGE_MAX_SPLITS = 4
# Decode arguments that follow the split count, so the batch size: the log-sum-exp strides (the partial outputs'
# strides are multiples of head_dim, divisible by 16 whatever the count).
DECODE_SPLIT_ARGS = ["num_splits", "stride_plb", "stride_plh"]
# Prefill tile: (query tokens per program, context tokens per step, num_warps, num_stages), how the kernel reads a
# step's own tokens (from the step's k/v, or back from the cache it just wrote) and whether it takes the query blocks
# the longest first. 64 query tokens: the flat grid gives each row a program per 64 tokens (on the H200 a 2,048-token
# bf16 prompt took 174.5 µs a layer against 227.2 with 128). With the step's k/v read and the longest blocks first, a
# 64-token context step of three stages: on an H100, 1 x 2,048 tokens 125.2 µs against 176.5 for (64, 32, 4, 2) read
# from the cache in order, 1,024 new over 1,024 cached 99.7 against 145.8, 16 decodes + 2,032 194.8 against 240.3,
# 8 x 512 127.9 against 128.6 (BENCHMARKS.md, the prefill kernel's reads and order; bench/attention_kernels.py
# --prefill-tiles times each setting).
PREFILL_CONFIG = (64, 64, 4, 3)
PREFILL_STEP_KV = True
PREFILL_HEAVY_FIRST = True
# Kernels take the block-table width as stride_bt with do_not_specialize: it changes from step to step, and Triton
# would JIT a new variant for each divisibility class it falls in (a 0.7 s stall in a serving step on an H200).
# Likewise every kernel gets the step's whole tables and picks its rows by their query length, never pointers offset
# past some rows: Triton specialises pointers on 16-byte alignment, so an offset built a variant after ready.


@triton.jit
def _store_kv(cache_ptr, dest, x, scale_ptr, heads, mask, num_kv_heads, KV_SCALED: tl.constexpr):
    """Store keys or values [heads, dims] at ``dest`` of the cache; in an FP8 cache each head divided by its scale and
    clamped to the format's range."""
    if KV_SCALED:
        x = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr + heads, mask=heads < num_kv_heads, other=1.0),
                     -FP8_MAX, FP8_MAX)
    tl.store(cache_ptr + dest, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_halves(row, out_row, cos_row, sin_row, halves, mask, stride_d, HALF: tl.constexpr):
    """transformers' rotation of a row's heads [heads, 2 x HALF] (``x * cos + rotate_half(x) * sin``, in float32,
    rounded once) from ``row`` to ``out_row`` (contiguous); returns the rotated halves as stored."""
    c1 = tl.load(cos_row + halves, mask=halves < HALF, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + halves, mask=halves < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + halves, mask=halves < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + halves, mask=halves < HALF, other=0.0).to(tl.float32)
    x1 = tl.load(row + halves * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + (HALF + halves) * stride_d, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * c1 - x2 * s1).to(out_row.dtype.element_ty)
    y2 = (x2 * c2 + x1 * s2).to(out_row.dtype.element_ty)
    tl.store(out_row + halves, y1, mask=mask)
    tl.store(out_row + HALF + halves, y2, mask=mask)
    return y1, y2


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_ot,
    stride_oh,
    num_kv_heads,
    num_heads,
    q_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_SCALED: tl.constexpr,
    ZERO_OUT: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """One program per token: copy its k/v [Hkv, D] into the cache at its slot, unless the slot is < 0. KV_SCALED
    (an FP8 cache): each head's k and v divided by its scale and clamped to the format's range first. ZERO_OUT: a
    token whose slot is < 0 (a graph's padding, in no sequence) gets zeros in its attention output row [Hq, D],
    which no attention kernel writes. ROTARY: k and the token's q [Hq, D] arrive unrotated; both are rotated at the
    token's tables (kiln.attention.rotary.rotate in float32, rounded once as Inductor's fused kernel rounds: a half
    of each head at a time) and written to k_out / q_out [T, H, D] (contiguous) for the attention kernels, every
    token's, padding's too, and k as rotated into the cache."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    if ZERO_OUT:
        q_heads = tl.arange(0, BLOCK_HQ)[:, None]
        tl.store(out_ptr + token * stride_ot + q_heads * stride_oh + dims,
                 tl.zeros([BLOCK_HQ, BLOCK_D], out_ptr.dtype.element_ty),
                 mask=(q_heads < num_heads) & (dims < HEAD_DIM) & (slot < 0))
    mask = (heads < num_kv_heads) & (slot >= 0) & (dims < HEAD_DIM)
    dest = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch
    if ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        halves = tl.arange(0, BLOCK_D // 2)[None, :]
        cos_row, sin_row = cos_ptr + token * stride_cos, sin_ptr + token * stride_sin
        q_heads = tl.arange(0, BLOCK_HQ)[:, None]
        _rotate_halves(q_ptr + token * stride_qt + q_heads * stride_qh,
                       q_out_ptr + token * stride_ot + q_heads * stride_oh, cos_row, sin_row, halves,
                       (q_heads < num_heads) & (halves < HALF), stride_qd, HALF)
        k1, k2 = _rotate_halves(k_ptr + token * stride_kt + heads * stride_kh,
                                k_out_ptr + token * stride_kot + heads * stride_koh, cos_row, sin_row, halves,
                                (heads < num_kv_heads) & (halves < HALF), stride_kd, HALF)
        in_cache = (heads < num_kv_heads) & (slot >= 0) & (halves < HALF)
        _store_kv(k_cache_ptr, dest + halves * stride_cd, k1, k_scale_ptr, heads, in_cache, num_kv_heads, KV_SCALED)
        _store_kv(k_cache_ptr, dest + (HALF + halves) * stride_cd, k2, k_scale_ptr, heads, in_cache, num_kv_heads,
                  KV_SCALED)
    else:
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        _store_kv(k_cache_ptr, dest + dims * stride_cd, k, k_scale_ptr, heads, mask, num_kv_heads, KV_SCALED)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    _store_kv(v_cache_ptr, dest + dims * stride_cd, v, v_scale_ptr, heads, mask, num_kv_heads, KV_SCALED)


@triton.jit
def _online_softmax(
    q,
    m_i,
    l_i,
    acc,
    k,
    v,
    pos,
    valid,
    q_pos,
    qk_scale,
    cap_scale,
    window,
    v_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_SCALED: tl.constexpr,
):
    """One online-softmax step of q's rows over the context tokens at ``pos``, whose keys and values are k, v.

    MASKED drops the tokens not ``valid`` and, with CAUSAL, those after each row's position ``q_pos``; with WINDOWED
    also those ``window`` or more before it. Scores are ``dot * qk_scale`` in log2 units; with SOFTCAP they are
    ``cap_scale * tanh(dot * qk_scale)`` (the caller folds the cap and log2(e) into the two scales). Without SOFTCAP
    the row maxima are taken over the dots and scaled after (qk_scale > 0), and the scale goes into the exponent's
    one multiply-add: one operation a score fewer than scaling every score first. V_SCALED (an FP8 cache's values):
    each value is multiplied by ``v_scale`` in fp32 and rounded to q's dtype, as the reference reads them; the
    multiply also makes Triton convert the tile before it goes to shared memory, where the dot reads it as 16-bit
    rows (ldmatrix) instead of byte by byte: 557 instructions a loop step of the decode kernel become 480 (SASS).
    """
    dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if SOFTCAP:
        dots = cap_scale * (2.0 * tl.sigmoid(2.0 * dots * qk_scale) - 1.0)  # tanh, in log2 units: a scale of 1
        qk_scale = 1.0
    if MASKED:
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        dots = tl.where(keep, dots, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(dots, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
    p = tl.exp2(dots * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_SCALED:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv(k_ptrs, v_ptrs, valid, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """A tile's keys and values [BLOCK_N, BLOCK_D]: with MASKED, zeros for the tokens not ``valid``; a head padded
    to BLOCK_D, zeros past HEAD_DIM; else loaded unmasked."""
    if MASKED:
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table,
    n0,
    end,
    q_pos,
    kv_head,
    qk_scale,
    cap_scale,
    window,
    v_scale,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_SCALED: tl.constexpr,
):
    """``_online_softmax`` over cached context tokens n0 .. n0 + BLOCK_N, read through the block table.

    MASKED drops tokens at or past ``end``, and the rest as ``_online_softmax`` says; with WINDOWED it loads none
    that is outside every row's window. An unmasked tile must lie wholly before ``end``, before every row's position
    and inside every row's window.
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    valid = pos < end
    if WINDOWED:  # never load what no row's window reaches: its block may be freed (the null block in the table)
        valid = valid & (pos > tl.min(q_pos, 0) - window)
    if MASKED:
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
    else:
        block = tl.load(table + pos // BLOCK_SIZE)
    offs = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_offs = offs[:, None] + dims[None, :] * stride_cd
    k, v = _load_kv(k_cache_ptr + kv_offs, v_cache_ptr + kv_offs, valid, dims, HEAD_DIM, BLOCK_D, MASKED)
    return _online_softmax(q, m_i, l_i, acc, k, v, pos, valid, q_pos, qk_scale, cap_scale, window, v_scale, MASKED,
                           CAUSAL, WINDOWED, SOFTCAP, DOT_PRECISION, V_SCALED)


@triton.jit
def _attend_step_tile(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    q_start,
    prefix,
    j0,
    end,
    q_pos,
    kv_head,
    qk_scale,
    cap_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``_online_softmax`` (causal) over the step's own tokens j0 .. j0 + BLOCK_N of the row that starts at token
    ``q_start``, read from the step's k/v instead of the cache: positions ``prefix + j``, masked at or past ``end``."""
    j = j0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    pos = prefix + j
    valid = pos < end
    # The tile's first token's row (a scalar, 64-bit) plus offsets inside the tile that do not change from tile to
    # tile: the loop computes one address a tile, not one a row.
    first = (q_start + j0).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)[:, None]
    k_tile = k_ptr + first * stride_kt + kv_head * stride_kh + (rows * stride_kt + dims[None, :] * stride_kd)
    v_tile = v_ptr + first * stride_vt + kv_head * stride_vh + (rows * stride_vt + dims[None, :] * stride_vd)
    k, v = _load_kv(k_tile, v_tile, valid, dims, HEAD_DIM, BLOCK_D, MASKED)
    return _online_softmax(q, m_i, l_i, acc, k, v, pos, valid, q_pos, qk_scale, cap_scale, 0, 1.0, MASKED, True,
                           False, SOFTCAP, DOT_PRECISION, False)


# Arguments that vary with the batch size (the split count and the strides it sets) are not specialised on: a
# captured batch size must not build a kernel of its own (each Triton build is ~0.5 s of a cold start).
@triton.jit(do_not_specialize=["stride_bt", "window", *DECODE_SPLIT_ARGS])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    counters_ptr,
    qk_scale,
    cap_scale,
    window,
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_counters,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr,
    MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Attend the query heads of one kv head over one split of one sequence's context (its window's tail of it).

    Writes the split's normalised output and its log2-sum-exp (-inf for an empty split); with one split, the output
    row itself (num_splits is not specialised on: a branch, not a variant). Several splits are merged by the reduce
    kernel, or with MERGE by the split of each (sequence, kv head) that ends last: each counts itself in on
    ``counters`` [B, Hkv] (zeros between calls), and the one that counts the last merges the partials and sets
    the count back to zero. KV_SCALED (an FP8 cache): the head's key scale is folded into the scores' scale, its
    value scale multiplies the value tiles.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    has_query = tl.load(query_start_loc_ptr + seq + 1) == token + 1  # a decode row: the prefill kernel takes others
    seq_len = tl.where(has_query, tl.load(seq_lens_ptr + seq), 0)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the one query sits at seq_len - 1
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=(groups[:, None] < GROUP) & (dims[None, :] < HEAD_DIM) & has_query,
        other=0.0,
    )

    v_scale = 1.0
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table,
            n0,
            end,
            end,
            kv_head,
            qk_scale,
            cap_scale,
            window,
            v_scale,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_cd,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            MASKED=True,
            CAUSAL=False,
            WINDOWED=False,
            SOFTCAP=SOFTCAP,
            DOT_PRECISION=DOT_PRECISION,
            V_SCALED=KV_SCALED,
        )

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    row_mask = groups < GROUP
    out_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    dest = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    if num_splits == 1:  # rows that are not decodes are left to the prefill kernel, as the reduce leaves them
        tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=out_mask & has_query)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part = part_out_ptr + seq.to(tl.int64) * stride_pob
        lse_row = part_lse_ptr + seq.to(tl.int64) * stride_plb + heads * stride_plh
        tl.store(part + split * stride_pos + heads[:, None] * stride_poh + dims[None, :], out, mask=out_mask)
        tl.store(lse_row + split, lse, mask=row_mask)
        if MERGE:
            # Every thread's partials written before the count (CUDA's last-block pattern: barrier, then one
            # acquire-release atomic); the merge reads them from L2 (.cg), never from a stale L1 line.
            tl.debug_barrier()
            counter = counters_ptr + seq.to(tl.int64) * stride_counters + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                splits = tl.arange(0, BLOCK_S)
                lses = tl.load(lse_row[:, None] + splits[None, :], mask=row_mask[:, None] & (splits < num_splits),
                               other=float("-inf"), cache_modifier=".cg")
                top = tl.max(lses, 1)
                top = tl.where(top == float("-inf"), 0.0, top)
                total = tl.zeros([BLOCK_G], tl.float32)
                merged = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
                for s in range(0, num_splits):
                    weight = tl.exp2(tl.load(lse_row + s, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
                                     - top)
                    partial = tl.load(part + s * stride_pos + heads[:, None] * stride_poh + dims[None, :],
                                      mask=out_mask, other=0.0, cache_modifier=".cg")
                    merged += weight[:, None] * partial
                    total += weight
                merged = merged / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(dest, merged.to(out_ptr.dtype.element_ty), mask=out_mask & has_query)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=DECODE_SPLIT_ARGS)
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LEAD: tl.constexpr,
):
    """Merge the splits of one (sequence, query head) into its output row; zeros when the context is empty. Rows
    that are not decodes (no query, or several) are left to the prefill kernel. LEAD: the kernel after it, launched
    with PDL (the output's quantize, kiln.programmatic_launch), may start now; it waits for this one to end."""
    release(LEAD)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    has_query = tl.load(query_start_loc_ptr + seq + 1) == token + 1
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_plb + head * stride_plh + splits, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    parts = tl.load(
        part_out_ptr + seq * stride_pob + head * stride_poh + splits[:, None] * stride_pos + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=has_query & (dims < HEAD_DIM),
    )


@triton.jit(do_not_specialize=["stride_bt", "window", "num_rows"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    cap_scale,
    window,
    num_rows,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    STEP_KV: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    """Causal attention of BLOCK_M query tokens of one sequence and one head over the sequence's context; with
    SKIP_DECODES, not of the sequences with one query token, which the decode kernels take.

    Without STEP_KV the whole context is read from the cache, in three runs of tiles: those a window edge crosses
    for some row (masked by window and causality), those inside every row's window and before every row
    (unmasked), and the causal diagonal (masked); without a window the first run is empty. With STEP_KV (no window,
    a cache in the model's dtype) only the cached prefix is read from the cache, and the step's own tokens from
    its k/v, where they lie in token order: no block table between them and the kernel. KV_SCALED as in the
    decode kernel.

    Grid: (query blocks, heads), the blocks of all rows in one run (vLLM's unified attention): row i's blocks are
    numbered from ``query_start_loc[i] // BLOCK_M + i``, which leaves room for each row's ceil(q_len / BLOCK_M)
    blocks, so ``tokens // BLOCK_M + rows`` programs cover every row, and a program finds its row by a binary search
    of the query starts. Programs past a row's queries (a row's unused numbers, padding rows) return at once. With
    HEAVY_FIRST the grid is (heads, query blocks) and the blocks are taken from the last: a row's later blocks
    attend more context, and starting them first, every head's, leaves the short ones to fill the last wave.
    """
    if HEAVY_FIRST:
        head = tl.program_id(0)
        block = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        block = tl.program_id(0)
        head = tl.program_id(1)
    lo = 0
    hi = num_rows - 1
    while lo < hi:  # the last row whose first block number is at most this program's
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= block:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    m_block = block - (q_start // BLOCK_M + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len or (SKIP_DECODES and q_len == 1):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = tl.maximum(seq_len - q_len, 0)  # context tokens before this step's queries (a padding row: none)
    kv_head = head // GROUP
    v_scale = 1.0
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_pos = prefix + m_block * BLOCK_M  # the block's first and last rows
    last_pos = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len) - 1
    end = tl.minimum(seq_len, last_pos + 1)
    if STEP_KV:
        # The cached prefix: before every row, so masked only past its end, in its last, partial tile.
        prefix_full = prefix // BLOCK_N * BLOCK_N
        for n0 in range(0, prefix_full, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, n0, prefix, q_pos, kv_head, qk_scale, cap_scale,
                window, v_scale, stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                MASKED=False, CAUSAL=False, WINDOWED=False, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
                V_SCALED=KV_SCALED,
            )
        for n0 in range(prefix_full, prefix, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, n0, prefix, q_pos, kv_head, qk_scale, cap_scale,
                window, v_scale, stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                MASKED=True, CAUSAL=False, WINDOWED=False, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
                V_SCALED=KV_SCALED,
            )
        # The step's own tokens: those wholly at or before the block's first row unmasked, then the diagonal.
        own_unmasked = (m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        for j0 in range(0, own_unmasked, BLOCK_N):
            m_i, l_i, acc = _attend_step_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, q_start, prefix, j0, end, q_pos, kv_head, qk_scale, cap_scale,
                stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, BLOCK_N,
                MASKED=False, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
            )
        for j0 in range(own_unmasked, end - prefix, BLOCK_N):
            m_i, l_i, acc = _attend_step_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, q_start, prefix, j0, end, q_pos, kv_head, qk_scale, cap_scale,
                stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, BLOCK_N,
                MASKED=True, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
            )
    else:
        # Tiles wholly at or before the first row's position need no causal mask.
        unmasked_end = tl.maximum(first_pos + 1, 0) // BLOCK_N * BLOCK_N
        # The first tile any row's window reaches, and the first from which every tile is in every row's window.
        window_start = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
        window_full = tl.where(window > 0, tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N, 0)
        for n0 in range(window_start, tl.minimum(window_full, end), BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, n0, end, q_pos, kv_head, qk_scale, cap_scale,
                window, v_scale, stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                MASKED=True, CAUSAL=True, WINDOWED=True, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
                V_SCALED=KV_SCALED,
            )
        for n0 in range(window_full, unmasked_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, n0, end, q_pos, kv_head, qk_scale, cap_scale,
                window, v_scale, stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                MASKED=False, CAUSAL=True, WINDOWED=False, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
                V_SCALED=KV_SCALED,
            )
        for n0 in range(tl.maximum(window_full, unmasked_end), end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, n0, end, q_pos, kv_head, qk_scale, cap_scale,
                window, v_scale, stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                MASKED=True, CAUSAL=True, WINDOWED=False, SOFTCAP=SOFTCAP, DOT_PRECISION=DOT_PRECISION,
                V_SCALED=KV_SCALED,
            )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _decode_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per sequence for DECODE_WAVES programs per multiprocessor: from shapes only, never this step's lengths."""
    fill = triton.cdiv(DECODE_WAVES * sm_count(device), batch * num_kv_heads)
    return max(1, min(fill, MAX_DECODE_SPLITS, triton.cdiv(max_context, MIN_SPLIT_TOKENS)))


def _block_d(head_dim: int) -> int:
    """head_dim padded to what tl.arange and tl.dot take: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    """How a dot of fp32 inputs uses the tensor cores: exactly, unless torch's float32 matmul precision lets the
    model's own matmuls use TF32 too (16-bit inputs multiply exactly either way)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) for _attend_tile: log2-unit scores, or the cap's tanh argument and its log2 scale."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0


def _kv_scales(kv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(keys' scales, values' scales) [Hkv] of an FP8 cache; (None, None) for a cache in the model's dtype."""
    return (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
             rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Store k/v [T, Hkv, D] at their slots of ``kv_cache``; slots < 0 are padding and left untouched. With ``out``
    (the attention output [T, Hq, D], its last dimension contiguous), the rows of padding tokens are set to zeros.
    With ``rotary`` (q [T, Hq, D] and the tables cos / sin [T, D], their last dimension contiguous; needs ``out``, the
    rotated q taking its strides), k and q arrive unrotated: k is rotated before it is stored, and (rotated q, rotated
    k) are returned."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_heads = 1 if out is None else out.shape[1]
    q, cos, sin = rotary or (None, None, None)
    q_out = None if q is None else torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
    k_out = None if q is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _write_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *_kv_scales(kv_scale),
        out,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *(out.stride()[:2] if out is not None else (0, 0)),
        num_kv_heads,
        num_heads,
        q,
        q_out,
        k_out,
        cos,
        sin,
        *(q.stride() if q is not None else (0, 0, 0)),
        *(k_out.stride()[:2] if k_out is not None else (0, 0)),
        cos.stride(0) if cos is not None else 0,
        sin.stride(0) if sin is not None else 0,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_SCALED=kv_scale is not None,
        ZERO_OUT=out is not None,
        ROTARY=q is not None,
    )
    return None if q is None else (q_out, k_out)


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int, softcap: float,
    out: torch.Tensor, kv_scale: torch.Tensor | None = None,
) -> None:
    batch = meta.seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2:4]
    group = num_heads // num_kv_heads
    max_context = meta.block_tables.shape[1] * block_size
    num_splits = _decode_splits(batch, num_kv_heads, min(max_context, window) if window > 0 else max_context,
                                q.device)
    part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    qk_scale, cap_scale = _scales(scale, softcap)
    if kv_scale is not None:
        block_n, num_warps, num_stages = DECODE_TILE_FP8_ONE_SPLIT if num_splits == 1 else DECODE_TILE_FP8
    else:
        block_n, num_warps, num_stages = DECODE_TILE_ONE_SPLIT if num_splits == 1 else DECODE_TILE
    counters = meta.split_counters
    merge = (counters is not None and counters.shape[0] >= batch and counters.shape[1] == num_kv_heads
             and num_splits <= MERGE_MAX_SPLITS)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        part_out,
        part_lse,
        out,
        *_kv_scales(kv_scale),
        counters if merge else None,
        qk_scale,
        cap_scale,
        window,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        meta.block_tables.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        *out.stride()[:2],
        counters.stride(0) if merge else 0,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SOFTCAP=softcap > 0,
        DOT_PRECISION=_dot_precision(q.dtype),
        KV_SCALED=kv_scale is not None,
        MERGE=merge,
        BLOCK_S=MAX_DECODE_SPLITS,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits == 1 or merge:
        return  # the split kernel wrote the output: the reduce would be a copy (~18 µs a layer at 128 rows, H100)
    _decode_reduce_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        meta.query_start_loc,
        num_splits,
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_S=MAX_DECODE_SPLITS,  # one kernel for every split count
        LEAD=programmatic_launch.SMALL_KERNEL_PDL and programmatic_launch.leads(batch * num_heads, out.device),
        num_warps=4,
    )


def _prefill_tile(block_d: int, itemsize: int, device: torch.device) -> tuple[int, int, int, int]:
    """PREFILL_CONFIG, with half the query tokens for a wide head (Gemma's 256: its fp32 accumulator kept in
    registers), and back to 32 context tokens in two stages where its K/V stages and q tile would not fit the device's
    shared memory (an Ada's 99 KB, against a Hopper's 227)."""
    block_m, block_n, num_warps, num_stages = PREFILL_CONFIG
    if block_d > 128:
        block_m //= 2
    shared = (2 * num_stages * block_n + block_m) * block_d * itemsize  # K and V tiles a stage, and q's
    if device.type == "cuda" and shared > max_shared_bytes(device):  # (TRITON_INTERPRET=1: CPU tensors, no limit)
        block_n, num_stages = 32, 2
    return block_m, block_n, num_warps, num_stages


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int, softcap: float, out: torch.Tensor, skip_decodes: bool, kv_scale: torch.Tensor | None = None,
) -> None:
    """Every sequence of ``meta`` but, with ``skip_decodes``, those of one query token (the decode kernels').

    The step's own tokens are read from k/v where the cache holds them as they are (no window, no FP8 scale)."""
    batch = meta.seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2:4]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = _block_d(head_dim)
    block_m, block_n, num_warps, num_stages = _prefill_tile(block_d, q.element_size(), q.device)
    blocks = q.shape[0] // block_m + batch
    grid = (num_heads, blocks) if PREFILL_HEAVY_FIRST else (blocks, num_heads)
    qk_scale, cap_scale = _scales(scale, softcap)
    _prefill_kernel[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        *_kv_scales(kv_scale),
        qk_scale,
        cap_scale,
        window,
        batch,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        meta.block_tables.stride(0),
        *out.stride()[:2],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SOFTCAP=softcap > 0,
        DOT_PRECISION=_dot_precision(q.dtype),
        KV_SCALED=kv_scale is not None,
        SKIP_DECODES=skip_decodes,
        STEP_KV=PREFILL_STEP_KV and window == 0 and kv_scale is None and k_cache.dtype == k.dtype,
        HEAVY_FIRST=PREFILL_HEAVY_FIRST,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int = 0, softcap: float = 0.0, kv_scale: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Write k/v into the cache, then attend each sequence's queries over its cached context -> [T, Hq, D].

    Tokens that belong to no sequence, and those of sequences with an empty context, get zeros. ``kv_scale``
    [2, Hkv] float32: the cache is FP8, each head's keys and values stored divided by their scale. ``rotary``
    (cos, sin [T, D]): q and k arrive unrotated, and the KV write rotates them (kiln.attention.rotary).

    The output is not filled first (at 2,048 tokens a fill was 6 µs of a 0.96 ms layer): the decode and prefill
    kernels write every token of every sequence, the decode kernel a graph's padding rows too, and the KV write
    the rows of tokens in no sequence (a mixed graph's padding, slot -1).
    """
    head_dim = q.shape[-1]
    if head_dim > MAX_CUDA_HEAD_DIM or head_dim != kv_cache.shape[-1]:
        raise ValueError(f"head_dim {head_dim} must be at most {MAX_CUDA_HEAD_DIM} and match the cache's "
                         f"{kv_cache.shape[-1]}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rotary is None:
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale, out)
    else:
        tables = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in rotary)
        q, k = write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale, out, (q, *tables))
    if meta.is_decode:  # every token is a row of one query (a graph's padding rows too), whose output it writes
        _decode(q, kv_cache, meta, scale, window, softcap, out, kv_scale)
    else:
        with_decodes = meta.num_decodes > 0 or meta.any_rows
        if with_decodes:
            _decode(q, kv_cache, meta, scale, window, softcap, out, kv_scale)
        _prefill(q, k, v, kv_cache, meta, scale, window, softcap, out, with_decodes, kv_scale)
    return out
