"""The Triton paged-attention kernels against the plain-torch reference, on random data.

On the GPU machine: ``python -m pytest -m gpu tests/test_attention_triton.py``. Without a GPU, Triton's interpreter
runs the same kernels on CPU tensors (slowly; numpy < 2.4 for triton 3.6's interpreter):
``TRITON_INTERPRET=1 python -m pytest -m gpu tests/test_attention_triton.py -k "small or window or softcap"``.
"""

import dataclasses
import importlib.util
import os
import random
import zlib
from dataclasses import dataclass, field

import pytest
import torch
from graph_replays import replays

from kiln.attention import reference as attention_reference
from kiln.attention.forward_context import AttentionMetadata

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                                  reason="needs a CUDA device or TRITON_INTERPRET=1 with triton")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}  # float32: no TF32 (the default)
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _seed(request):
    """Different random data for every case, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    layer: dict = field(default_factory=dict)  # the layer's window and softcap


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    padding_rows: int = 0,
    device: str = DEVICE,
    window: int = 0,
    softcap: float = 0.0,
) -> Case:
    """A step over sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` context tokens are new.

    Blocks are scattered at random over a randomly filled cache; q/k/v are strided views of one fused qkv tensor.
    Each padding row owns one token with slot -1 and an empty context, as a CUDA-graph batch pads decode.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq, default=0) + 2
    block_tables = torch.zeros(len(seq_lens) + padding_rows, width, dtype=torch.int32)
    slots = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = [order.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
    slots += [-1] * padding_rows
    all_query_lens = list(query_lens) + [1] * padding_rows
    query_start_loc = torch.tensor([0] + all_query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(list(seq_lens) + [0] * padding_rows, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(all_query_lens),
        num_seqs=len(seq_lens),
        num_decodes=next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens)),
    )
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return Case(q, k, v, kv_cache, meta, head_dim**-0.5, dict(window=window, softcap=softcap))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(case: Case) -> torch.Tensor:
    """Run kernels and reference on copies of one cache; outputs must agree and the caches must be equal. Returns
    the kernels' output."""
    from kiln.attention import triton_kernels as attention_triton

    if DEVICE == "cpu" and case.q.dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (numpy has no bfloat16); the GPU runs these")
    ref_cache = case.kv_cache.clone()
    ref = attention_reference.paged_attention(case.q, case.k, case.v, ref_cache, case.meta, case.scale, **case.layer)
    out = attention_triton.paged_attention(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale, **case.layer)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all()
    if case.kv_cache.dtype == FP8:  # Triton's float32 divide is approximate: a quotient at a rounding edge may land
        # one e4m3 step from torch's
        assert (case.kv_cache.view(torch.uint8) == ref_cache.view(torch.uint8)).float().mean() > 0.999
        torch.testing.assert_close(case.kv_cache.float(), ref_cache.float(), rtol=2.0 ** -3, atol=2.0 ** -9)
    else:
        torch.testing.assert_close(case.kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)  # NaN: a null block
    padding = case.meta.query_start_loc[case.meta.num_seqs].item()
    assert not out[padding:].any()
    assert relative_error(out, ref) < TOLERANCE[case.q.dtype]
    return out


def free_outside_windows(case: Case) -> None:
    """Leave the case's block tables as BlockManager leaves a windowed sequence's: each block wholly before the
    window of the sequence's first query of the step is given back, its entry naming the null block, here a block
    of NaN appended to the cache, so a kernel that read it would output NaN."""
    window, block_size = case.layer["window"], case.kv_cache.shape[2]
    null = case.kv_cache.shape[1]
    nan_block = torch.full_like(case.kv_cache[:, :1], float("nan"))
    case.kv_cache = torch.cat([case.kv_cache, nan_block], dim=1)
    meta = case.meta
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    for i, (seq_len, query_len) in enumerate(zip(meta.seq_lens.tolist()[:meta.num_seqs], query_lens, strict=False)):
        first_read = seq_len - query_len - window + 1
        meta.block_tables[i, :max(0, first_read // block_size)] = null


def check_freed_outside_windows(case: Case) -> None:
    """The same step before and after the blocks outside its windows are freed: the kernels give the same output."""
    ref_cache = case.kv_cache.clone()
    expected = attention_reference.paged_attention(case.q, case.k, case.v, ref_cache, case.meta, case.scale,
                                                   **case.layer)
    free_outside_windows(case)
    assert (case.meta.block_tables == case.kv_cache.shape[1] - 1).any(), "the case frees no block"
    out = check(case)
    assert relative_error(out, expected) < TOLERANCE[case.q.dtype]


# (batch, num_heads, num_kv_heads, head_dim, block_size, dtype): GQA groups 1/4/8, head_dim 64/128, block 16/32.
DECODE_SHAPES = [
    (1, 32, 8, 128, 16, torch.bfloat16),
    (7, 8, 8, 64, 32, torch.float32),
    (33, 32, 4, 128, 32, torch.bfloat16),
    (64, 16, 4, 64, 16, torch.bfloat16),
    (64, 8, 1, 128, 16, torch.float32),
    (5, 4, 4, 128, 16, torch.float16),
    (16, 32, 8, 128, 32, torch.float32),
    (2, 8, 1, 64, 32, torch.bfloat16),
]


def with_split_counters(case: Case, rows: int = 0) -> torch.Tensor:
    """Give the case's step the counters the runner keeps (StepBuffers.split_counters: ``rows``, default a row more
    than the step's): the decode's splits merged by the last of each (sequence, kv head) to end, no reduce kernel.
    Returns them."""
    rows = rows or case.meta.seq_lens.shape[0] + 1
    counters = torch.zeros(rows, case.k.shape[1], dtype=torch.int32, device=DEVICE)
    case.meta = dataclasses.replace(case.meta, split_counters=counters)
    return counters


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
@pytest.mark.parametrize("padding_rows", [0, 3])
@pytest.mark.parametrize("merged", [False, True], ids=["reduce", "last-split-merges"])
def test_decode(shape, padding_rows, merged, monkeypatch):
    """Decodes against the reference, their splits merged by the reduce kernel or by the last split (at any split
    count here: the engine leaves more than MERGE_MAX_SPLITS to the reduce for speed); under Triton's interpreter
    (one "SM") as if on 64 SMs, so that every context splits there too."""
    from kiln.attention import triton_kernels as attention_triton

    if DEVICE == "cpu":
        monkeypatch.setattr(attention_triton, "sm_count", lambda device: 64)
    if merged:
        monkeypatch.setattr(attention_triton, "MERGE_MAX_SPLITS", attention_triton.MAX_DECODE_SPLITS)
    batch, num_heads, num_kv_heads, head_dim, block_size, dtype = shape
    rng = random.Random(str((shape, padding_rows)))
    seq_lens = [rng.randint(1, 4000) for _ in range(batch)]
    seq_lens[0] = 1
    if batch > 2:
        seq_lens[1] = 4000
    case = make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, padding_rows)
    counters = with_split_counters(case) if merged else None
    check(case)
    assert counters is None or not counters.any()  # each count back to zero for the next layer's call
    assert attention_triton._decode_splits(batch + padding_rows, num_kv_heads, 4000, case.q.device) > 1


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter builds no kernels")
def test_decode_builds_no_kernel_of_its_own_at_any_batch_size():
    """CUDA-graph capture decodes at every capture size, and the split count follows the batch size: no size may
    build kernels of its own (a cold start paid ~0.5 s a build, 3.5 s of capture on the H200). The decode kernels
    are two variants, one for several splits a sequence and one for one split (the largest sizes, whose split
    kernel writes the output without the reduce): a size of each builds both, and the others nothing more."""
    from kiln.attention import triton_kernels as attention_triton

    kernels = (attention_triton._decode_split_kernel, attention_triton._decode_reduce_kernel)

    def built() -> int:
        return sum(len(kernel.device_caches[device][0]) for kernel in kernels for device in kernel.device_caches)

    splits, first = [], None
    for batch in (1, 128, 2, 3, 5, 8, 16, 33, 64, 100):
        case = make_case([2000] * batch, [1] * batch, 32, 8, 128, 16, torch.bfloat16)
        splits.append(attention_triton._decode_splits(batch, 8, 2000, case.q.device))
        check(case)
        first = built() if batch == 128 else first
    assert splits[0] > 1 and splits[1] == 1 and len(set(splits)) > 4 and built() == first


@needs_cuda
@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter builds no kernels")
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
def test_the_warm_up_builds_every_decode_variant_a_serving_step_takes(fp8):
    """The execute service's attention warm-up, then decode steps as serving launches them from Python (split
    counters for every row, tables as wide as a 2,100-token model's) at every batch size from 1 to 128: one split
    (the largest), 2-4 merged by the last split, more left to the reduce; nothing built past the warm-up. A shape of
    its own (24 heads over 8 kv heads of 48), so that no other test has built its variants before: the warm-up must."""
    from exec_service.startup.compiled_function import warm_up_blocks, warm_up_paged_attention
    from kiln.attention import triton_kernels as attention_triton

    num_heads, num_kv_heads, head_dim, block_size, max_seqs = 24, 8, 48, 16, 128
    cache_dtype = FP8 if fp8 else torch.bfloat16
    kv_scales = [torch.full((2, num_kv_heads), 0.05, device=DEVICE)] if fp8 else None
    kernels = (attention_triton._decode_split_kernel, attention_triton._decode_reduce_kernel)

    def built() -> set:
        return {(kernel.__name__, str(key)) for kernel in kernels for cache in kernel.device_caches.values()
                for key in cache[0]}

    def forward(input_ids, positions, kv_caches, meta, scales):
        """The model's one attention layer, its q/k/v random."""
        q, k, v = torch.randn(num_heads + 2 * num_kv_heads, len(positions), head_dim, dtype=torch.bfloat16,
                              device=DEVICE).split([num_heads, num_kv_heads, num_kv_heads])
        attention_triton.paged_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), kv_caches[0], meta,
                                         head_dim**-0.5, kv_scale=scales[0] if scales else None)

    scratch = torch.zeros(2, warm_up_blocks(block_size), block_size, num_kv_heads, head_dim, dtype=cache_dtype,
                          device=DEVICE)
    warm_up_paged_attention(forward, [scratch], block_size, DEVICE, kv_scales)
    warmed = built()
    counters = torch.zeros(max_seqs, num_kv_heads, dtype=torch.int32, device=DEVICE)
    width = -(-2100 // block_size)
    rng = random.Random(29)
    splits = set()
    for batch in range(1, max_seqs + 1):
        case = make_case([rng.randint(1, 2100) for _ in range(batch)], [1] * batch, num_heads, num_kv_heads, head_dim,
                         block_size, torch.bfloat16)
        tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
        used = min(case.meta.block_tables.shape[1], width)  # make_case's tables: each sequence's blocks, 2 spare
        tables[:, :used] = case.meta.block_tables[:, :used]
        case.meta = dataclasses.replace(case.meta, block_tables=tables, split_counters=counters)
        if fp8:
            case = fp8_case(case, kv_scales[0])
        forward(None, case.meta.slot_mapping, [case.kv_cache], case.meta, kv_scales)
        splits.add(attention_triton._decode_splits(batch, num_kv_heads, width * block_size, case.q.device))
    assert 1 in splits and splits & set(range(2, attention_triton.MERGE_MAX_SPLITS + 1))
    assert max(splits) > attention_triton.MERGE_MAX_SPLITS
    assert built() == warmed, f"built after the warm-up: {sorted(built() - warmed)}"


def fp8_case(case: Case, kv_scale: torch.Tensor) -> Case:
    """The case over an FP8 cache holding its cache's values divided by each kv head's scale ([2, Hkv]: keys',
    values'), as the execute service's FP8 KV cache stores them."""
    scaled = case.kv_cache.float() / kv_scale[:, None, None, :, None]
    case.kv_cache = scaled.clamp(-attention_reference.FP8_MAX, attention_reference.FP8_MAX).to(FP8)
    case.layer["kv_scale"] = kv_scale
    return case


# (seq_lens, query_lens): a decode step of short and long contexts (on a GPU several splits a sequence, and as if on
# one SM one split: each split count has its own tile), a mixed step
FP8_CACHE_STEPS = {"decode": ([1, 300, 17, 1030, 64, 2000], [1] * 6),
                   "decode-one-split": ([1, 300, 17, 1030, 64, 2000], [1] * 6),
                   "mixed": ([300, 17, 700, 90], [1, 1, 200, 90])}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("step", FP8_CACHE_STEPS)
def test_an_fp8_cache_is_written_and_read_as_the_reference_does(step, dtype, monkeypatch):
    """The kernels over an FP8 cache (the keys' scale folded into the scores', each value tile multiplied by its scale
    as it is read) against the reference, which multiplies each value back before it attends. The scales put N(0, 1)
    values over e4m3's range up to its clamp at 448, the new tokens' too."""
    from kiln.attention import triton_kernels as attention_triton

    seq_lens, query_lens = FP8_CACHE_STEPS[step]
    if step == "decode-one-split":
        monkeypatch.setattr(attention_triton, "sm_count", lambda device: 1)
        assert attention_triton._decode_splits(len(seq_lens) + 2, 8, 2000, torch.device(DEVICE)) == 1
    case = make_case(seq_lens, query_lens, 32, 8, 128, 16, dtype, padding_rows=2)
    kv_scale = torch.rand(2, 8, device=DEVICE) * 0.02 + 0.005
    if INTERPRETED:  # its float8 cast drops a rounded-up mantissa's carry (a value just under 128 becomes 64): scales
        # of powers of two and new keys and values that e4m3 holds as they are, so that no cast rounds
        kv_scale = 2.0 ** -torch.randint(5, 9, (2, 8), device=DEVICE).float()
        for x, scale in zip((case.k, case.v), kv_scale, strict=True):
            held = (x.float() / scale[:, None]).clamp(-attention_reference.FP8_MAX, attention_reference.FP8_MAX)
            x.copy_(held.to(FP8).float() * scale[:, None])
    check(fp8_case(case, kv_scale))


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_an_fp8_caches_smallest_values_are_read_as_they_are(step):
    """Values of e4m3's subnormal range and its smallest normals (most of a cache written at the default scale of 1
    from N(0, 0.01) data; the new tokens' too) reach the dots as they are stored, not flushed to zero, as any
    change to how the kernels widen the cache's bytes must keep them."""
    seq_lens, query_lens = FP8_CACHE_STEPS[step]
    case = make_case(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, padding_rows=2)
    for x in (case.k, case.v, case.kv_cache):
        x.mul_(0.01)
    case = fp8_case(case, torch.ones(2, 8, device=DEVICE))
    stored = case.kv_cache.float().abs()
    assert ((stored > 0) & (stored < 2.0 ** -6)).float().mean() > 0.4  # most of the cache is subnormal in e4m3
    check(case)


# (seq_lens, query_lens): fresh prefill, mixed prefill + decode (the leading decodes go to the decode kernels),
# prefill over a cached prefix (e.g. recompute).
PREFILL_STEPS = {
    "prefill": ([37, 128, 5, 300, 64], [37, 128, 5, 300, 64]),
    "mixed": ([101, 3001, 50, 8, 264, 1], [1, 1, 50, 1, 200, 1]),
    "decodes_first": ([700, 3001, 90, 1, 1500, 64], [1, 1, 1, 1, 300, 64]),  # as the engine orders a mixed step
    "cached_prefix": ([1017, 97, 2630, 65], [17, 64, 130, 65]),
    "long": ([1500, 700], [1500, 333]),
}
PREFILL_SHAPES = [
    (32, 8, 128, 16, torch.bfloat16),
    (8, 8, 64, 32, torch.float32),
    (16, 2, 64, 16, torch.bfloat16),
    (8, 1, 128, 32, torch.float32),
    (4, 4, 128, 32, torch.float16),
]


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=str)
@pytest.mark.parametrize("step", PREFILL_STEPS)
def test_prefill(shape, step):
    seq_lens, query_lens = PREFILL_STEPS[step]
    check(make_case(seq_lens, query_lens, *shape))


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter multiplies float32 exactly whatever the precision")
def test_float32_dots_follow_torchs_matmul_precision():
    """A float32 model's attention computes in float32 (Triton's dots default to TF32, ~1e-3 off);
    set_float32_matmul_precision("high") lets the kernels use TF32, as it lets cuBLAS."""
    from kiln.attention import triton_kernels as attention_triton

    case = make_case([1500, 700, 1], [1500, 333, 1], 8, 8, 64, 32, torch.float32)
    ref = attention_reference.paged_attention(case.q, case.k, case.v, case.kv_cache.clone(), case.meta, case.scale)

    def error() -> float:
        return relative_error(attention_triton.paged_attention(case.q, case.k, case.v, case.kv_cache, case.meta,
                                                               case.scale), ref)

    assert error() < TOLERANCE[torch.float32]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert TOLERANCE[torch.float32] < error() < 1e-2
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_with_padding_rows(dtype):
    check(make_case([300, 41, 900], [300, 1, 77], 16, 4, 128, 16, dtype, padding_rows=5))


def as_mixed_graph(case: Case, num_tokens: int, num_rows: int) -> Case:
    """``case`` as a mixed CUDA graph of ``num_tokens`` tokens and ``num_rows`` rows runs it (StepBuffers.
    mixed_graph_metadata): tokens past the step's in no sequence (slot -1), rows past its sequences with no query and
    an empty context, the longest query bounded by the token count, both kinds of kernel over every row."""
    meta, real = case.meta, case.q.shape[0]
    pad, extra_rows = num_tokens - real, num_rows - meta.seq_lens.shape[0]

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.randn(pad, *t.shape[1:], dtype=t.dtype, device=t.device)])

    qkv = torch.cat([grow(case.q), grow(case.k), grow(case.v)], dim=1)
    q, k, v = qkv.split([case.q.shape[1], case.k.shape[1], case.v.shape[1]], dim=1)
    device = case.q.device
    graph_meta = AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=device)]),
        query_start_loc=torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].expand(extra_rows)]),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(extra_rows, dtype=torch.int32, device=device)]),
        block_tables=torch.cat([meta.block_tables, torch.zeros(extra_rows, meta.block_tables.shape[1],
                                                               dtype=torch.int32, device=device)]),
        max_query_len=num_tokens, num_seqs=num_rows, any_rows=True, split_counters=meta.split_counters)
    return Case(q, k, v, case.kv_cache, graph_meta, case.scale, case.layer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 24])
def test_a_mixed_graph_step_gives_the_steps_own_attention(dtype, window):
    """Decodes first, a prefill, a one-token chunk between prefills, padded as a mixed graph pads it: the real rows
    equal the unpadded step's, the padding tokens are zeros and write nothing."""
    from kiln.attention import triton_kernels as attention_triton

    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (numpy has no bfloat16); the GPU runs these")
    case = make_case([40, 9, 70, 33, 5], [1, 1, 30, 1, 5], 8, 2, 64, 16, dtype, window=window)
    counters = with_split_counters(case, rows=12)
    real = case.q.shape[0]
    ref_cache = case.kv_cache.clone()
    ref = attention_reference.paged_attention(case.q, case.k, case.v, ref_cache, case.meta, case.scale, **case.layer)
    graph = as_mixed_graph(case, 48, 12)
    out = attention_triton.paged_attention(graph.q, graph.k, graph.v, graph.kv_cache, graph.meta, graph.scale,
                                           **graph.layer)
    torch.testing.assert_close(graph.kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)
    assert not out[real:].any() and not counters.any()
    assert relative_error(out[:real], ref) < TOLERANCE[dtype]


@needs_cuda
def test_a_mixed_graph_replays_any_mix_of_rows_within_its_size():
    """One capture at 48 tokens and 12 rows, replayed with other mixes: all decodes, one long prefill, decodes and
    chunks, fewer rows; each equal to the reference on its own unpadded metadata."""
    from kiln.attention import triton_kernels as attention_triton

    tokens, rows, num_heads, num_kv_heads, head_dim, block_size, dtype = 48, 12, 16, 4, 128, 16, torch.bfloat16
    mixes = [([40, 9, 70, 33, 5], [1, 1, 30, 1, 5]), ([300] * 12, [1] * 12), ([48], [48]),
             ([900, 17, 64], [1, 17, 30]), ([3, 1000, 2000, 1], [3, 20, 1, 1])]
    cases = [make_case(lens, queries, num_heads, num_kv_heads, head_dim, block_size, dtype) for lens, queries in mixes]
    graphs = [as_mixed_graph(case, tokens, rows) for case in cases]
    width = max(g.meta.block_tables.shape[1] for g in graphs)
    first = graphs[0]  # the static step the graph reads: its own tensors, the tables at the widest
    static = Case(first.q.clone(), first.k.clone(), first.v.clone(), first.kv_cache, dataclasses.replace(
        first.meta, slot_mapping=first.meta.slot_mapping.clone(), query_start_loc=first.meta.query_start_loc.clone(),
        seq_lens=first.meta.seq_lens.clone(),
        block_tables=torch.zeros(rows, width, dtype=torch.int32, device=DEVICE)), first.scale)
    cache = torch.randn(2, max(g.kv_cache.shape[1] for g in graphs), block_size, num_kv_heads, head_dim, dtype=dtype,
                        device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention_triton.paged_attention(static.q, static.k, static.v, cache.clone(), static.meta, static.scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_triton.paged_attention(static.q, static.k, static.v, cache, static.meta, static.scale)
    for case, padded in zip(cases, graphs, strict=True):
        meta = static.meta
        for name in ("slot_mapping", "query_start_loc", "seq_lens"):
            getattr(meta, name).copy_(getattr(padded.meta, name))
        meta.block_tables.zero_()
        meta.block_tables[:, :padded.meta.block_tables.shape[1]] = padded.meta.block_tables
        for mine, theirs in ((static.q, padded.q), (static.k, padded.k), (static.v, padded.v)):
            mine.copy_(theirs)
        cache[:, :padded.kv_cache.shape[1]] = padded.kv_cache
        ref_cache = cache.clone()
        real = case.q.shape[0]
        ref = attention_reference.paged_attention(case.q, case.k, case.v, ref_cache, case.meta, case.scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, ref_cache)
        assert torch.isfinite(out).all() and not out[real:].any()
        assert relative_error(out[:real], ref) < TOLERANCE[dtype]


def test_write_kv_skips_padding_slots():
    """Padding slots (< 0) write nothing into the cache; given the attention output, the KV write sets the rows of
    those tokens to zeros (no attention kernel writes them) and leaves every other row as it was."""
    from kiln.attention import triton_kernels as attention_triton

    case = make_case([40, 9, 70], [40, 9, 3], 8, 2, 64, 16, torch.bfloat16, padding_rows=4)
    slots = case.meta.slot_mapping
    slots[::2] = -1
    before = case.kv_cache.clone()
    out = torch.full_like(case.q, float("nan"))
    attention_triton.write_kv(case.k, case.v, case.kv_cache, slots, out=out)
    assert not out[slots < 0].any() and out[slots >= 0].isnan().all()
    flat = case.kv_cache.view(2, -1, *case.kv_cache.shape[3:])
    written = slots >= 0
    assert torch.equal(flat[0, slots[written]], case.k[written])
    assert torch.equal(flat[1, slots[written]], case.v[written])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=slots.device)
    untouched[slots[written]] = False
    assert torch.equal(flat[:, untouched], before.view_as(flat)[:, untouched])


@needs_cuda
@pytest.mark.parametrize("window", [0, 300])
def test_decode_cuda_graph_replay(window):
    """Capture one decode step, then replay it with new lengths, block tables, slots and fewer real sequences."""
    from kiln.attention import triton_kernels as attention_triton

    batch, num_heads, num_kv_heads, head_dim, block_size, dtype = 8, 32, 8, 128, 16, torch.bfloat16
    max_context = 4000
    width = -(-max_context // block_size)
    num_blocks = batch * width
    case = make_case([5] * batch, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype)
    q, k, v, meta = case.q, case.k, case.v, case.meta
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    block_tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    block_tables[:, :1] = meta.block_tables[:, :1]
    meta.block_tables = block_tables

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention_triton.paged_attention(q, k, v, kv_cache, meta, case.scale, window)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_triton.paged_attention(q, k, v, kv_cache, meta, case.scale, window)

    rng = random.Random(0)
    for num_seqs in (8, 6, 3):
        seq_lens = [rng.randint(1, max_context) for _ in range(num_seqs)] + [0] * (batch - num_seqs)
        blocks = torch.randperm(num_blocks, device="cuda")[: batch * width].view(batch, width).to(torch.int32)
        positions = torch.tensor(seq_lens, device="cuda").clamp(min=1) - 1
        slots = blocks.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
        slots[num_seqs:] = -1
        meta.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        meta.block_tables.copy_(blocks)
        meta.slot_mapping.copy_(slots)
        for tensor in (q, k, v):
            tensor.copy_(torch.randn_like(tensor))
        ref_meta = AttentionMetadata(
            meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables, 1, num_seqs
        )
        ref_cache = kv_cache.clone()
        ref = attention_reference.paged_attention(q, k, v, ref_cache, ref_meta, case.scale, window)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kv_cache, ref_cache)
        assert torch.isfinite(out).all() and not out[num_seqs:].any()
        assert relative_error(out, ref) < TOLERANCE[dtype]


@needs_cuda
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (64, 0.0), (64, 20.0)])
def test_attention_op_runs_the_triton_kernels(window, softcap):
    """``kiln::attention`` on CUDA inside a forward context reaches these kernels (reference-equal output)."""
    from kiln.attention.forward_context import ForwardContext, forward_context
    from kiln.attention.op import attention

    case = make_case([700, 90], [100, 1], 16, 4, 128, 16, torch.bfloat16, window=window, softcap=softcap)
    ref_cache = case.kv_cache.clone()
    ref = attention_reference.paged_attention(case.q, case.k, case.v, ref_cache, case.meta, case.scale, **case.layer)
    with forward_context(ForwardContext(kv_caches=[None, case.kv_cache], metadata=case.meta)):
        out = attention(case.q, case.k, case.v, torch.tensor(1), case.scale, window, softcap)
    assert torch.equal(case.kv_cache, ref_cache)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


# Small enough for Triton's interpreter on CPU; on the GPU they run with the rest.
SMALL_STEPS = {
    "small_decode": ([1, 40, 75, 130], [1, 1, 1, 1]),
    "small_prefill": ([37, 70, 5], [37, 70, 5]),
    "small_mixed": ([101, 50, 8, 90], [1, 50, 1, 33]),
}


@pytest.mark.parametrize("step", SMALL_STEPS)
@pytest.mark.parametrize("head_dim", [64, 96, 24])
def test_small_steps_any_head_dim(step, head_dim):
    """Phi-3's head_dim 96 and a tiny 24 are padded to a power of two inside the kernels."""
    seq_lens, query_lens = SMALL_STEPS[step]
    check(make_case(seq_lens, query_lens, 8, 2, head_dim, 16, torch.float32, padding_rows=2))


# Windows shorter than a tile, one token, a block, longer than some contexts; each with and without a prefix.
WINDOWS = [1, 5, 16, 33, 64, 4096]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("step", SMALL_STEPS)
def test_small_steps_sliding_window(step, window):
    seq_lens, query_lens = SMALL_STEPS[step]
    check(make_case(seq_lens, query_lens, 8, 2, 64, 16, torch.float32, padding_rows=1, window=window))


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("step", SMALL_STEPS)
def test_small_steps_softcap(step, window):
    """A cap small against the logits (q, k ~ N(0, 1) give logits of a few units), so it changes the result."""
    seq_lens, query_lens = SMALL_STEPS[step]
    check(make_case(seq_lens, query_lens, 8, 4, 64, 16, torch.float32, window=window, softcap=1.5))


def rotary_tables(num_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos / sin [T, D] (the halves alike) at random positions, in ``dtype``."""
    angles = torch.rand(num_tokens, 1, device=DEVICE) * 4096 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE)
                                                                         / head_dim)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("step", SMALL_STEPS)
def test_the_kv_write_rotates_q_and_k_as_the_compiled_rotation_does(step, fp8):
    """Given the rotary tables, the KV write rotates q and k (kiln.attention.rotary.route_rotary took the rotation out
    of the graph), padding rows included, head_dim 96 padded to 128: q and k rotated as in float32, rounded once (as
    Inductor's fused kernel rounds; within a bfloat16 step: Triton's interpreter rounds toward zero, a GPU to nearest
    and may fuse the product and sum), the cache written and the attention attending exactly as the kernels do with
    those rotated q and k given."""
    from kiln.attention import triton_kernels as attention_triton
    from kiln.attention.rotary import rotate

    seq_lens, query_lens = SMALL_STEPS[step]
    case = make_case(seq_lens, query_lens, 8, 2, 96, 16, torch.bfloat16, padding_rows=2)
    if fp8:
        case = fp8_case(case, torch.rand(2, 2, device=DEVICE) * 0.02 + 0.005)
    kv_scale, slots = case.layer.get("kv_scale"), case.meta.slot_mapping
    cos, sin = rotary_tables(case.q.shape[0], 96, torch.bfloat16)
    caches = [case.kv_cache.clone() for _ in range(4)]
    rotated = attention_triton.write_kv(case.k, case.v, caches[0], slots, kv_scale, torch.empty_like(case.q),
                                        (case.q, cos, sin))
    for got, x in zip(rotated, (case.q, case.k), strict=True):
        want = rotate(x.float(), cos.float(), sin.float())
        assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-6).all()
    attention_triton.write_kv(rotated[1], case.v, caches[1], slots, kv_scale, torch.empty_like(case.q))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    out = attention_triton.paged_attention(case.q, case.k, case.v, caches[2], case.meta, case.scale,
                                           kv_scale=kv_scale, rotary=(cos, sin))
    ref = attention_triton.paged_attention(*rotated, case.v, caches[3], case.meta, case.scale, kv_scale=kv_scale)
    assert torch.equal(caches[2].view(torch.uint8), caches[3].view(torch.uint8))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("step_kv, heavy_first", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", SMALL_STEPS)
def test_prefill_reads_a_steps_own_tokens_and_orders_its_blocks_either_way(monkeypatch, step, dtype, step_kv,
                                                                           heavy_first):
    """The prefill kernel's settings (the step's own keys and values from its k/v or from the cache, query blocks in
    order or the longest first) give the same attention, with and without a window or a cap (where the step's k/v
    are not read)."""
    from kiln.attention import triton_kernels as attention_triton

    monkeypatch.setattr(attention_triton, "PREFILL_STEP_KV", step_kv)
    monkeypatch.setattr(attention_triton, "PREFILL_HEAVY_FIRST", heavy_first)
    seq_lens, query_lens = SMALL_STEPS[step]
    for window, softcap in [(0, 0.0), (0, 1.5), (16, 0.0)]:
        check(make_case(seq_lens, query_lens, 8, 2, 64, 16, dtype, padding_rows=2, window=window, softcap=softcap))


@pytest.mark.parametrize("shape", [(32, 8, 128, 16, torch.bfloat16), (8, 4, 256, 16, torch.bfloat16),
                                   (16, 8, 96, 32, torch.float16)], ids=str)
@pytest.mark.parametrize("window", [0, 100, 1024])
@pytest.mark.parametrize("step", PREFILL_STEPS)
def test_prefill_sliding_window_and_softcap(shape, step, window):
    """Local layers as Mistral (window 4096 of long contexts, here shorter) and Gemma 2 (head_dim 256, softcap 50)."""
    seq_lens, query_lens = PREFILL_STEPS[step]
    softcap = 50.0 if shape[2] == 256 else 0.0
    check(make_case(seq_lens, query_lens, *shape, window=window, softcap=softcap))


@pytest.mark.parametrize("shape", DECODE_SHAPES[:4] + [(9, 8, 4, 256, 16, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("window", [1, 100, 1024])
def test_decode_sliding_window_and_softcap(shape, window):
    batch, num_heads, num_kv_heads, head_dim, block_size, dtype = shape
    rng = random.Random(str((shape, window)))
    seq_lens = [rng.randint(1, 4000) for _ in range(batch)]
    softcap = 50.0 if head_dim == 256 else 0.0
    check(make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, padding_rows=2,
                    window=window, softcap=softcap))


@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("step", ["small_decode", "small_mixed"])  # a fresh prefill has nothing to free
def test_small_steps_sliding_window_never_read_freed_blocks(step, window):
    seq_lens, query_lens = SMALL_STEPS[step]
    check_freed_outside_windows(make_case(seq_lens, query_lens, 8, 2, 64, 16, torch.float32, padding_rows=1,
                                          window=window))


@pytest.mark.parametrize("shape", [(32, 8, 128, 16, torch.bfloat16), (16, 8, 96, 32, torch.float16)], ids=str)
@pytest.mark.parametrize("window", [100, 300])
@pytest.mark.parametrize("step", [step for step in PREFILL_STEPS if step != "prefill"])
def test_sliding_window_never_reads_freed_blocks(shape, step, window):
    """Steps of GPU size (prefill tiles a window edge crosses, decodes, cached prefixes) over freed blocks."""
    seq_lens, query_lens = PREFILL_STEPS[step]
    check_freed_outside_windows(make_case(seq_lens, query_lens, *shape, window=window))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90 or later")
def test_the_decode_reduce_releasing_the_output_quantize_changes_no_bit(monkeypatch):
    """A batch-1 decode over 1,024 tokens (split, merged by the reduce kernel), its output quantized and multiplied
    by o's FP8 weight, replayed from CUDA graphs captured with the small kernels launched with PDL and without: the
    reduce releases the quantize, the quantize the product, each waiting before it reads (kiln.programmatic_launch).
    A kernel reading its input before the one that writes it has ended would differ."""
    from kiln import programmatic_launch
    from kiln.attention import triton_kernels as attention_triton
    from kiln.quantization.fp8_linear import quantize_rows
    from kiln.quantization.fp8_small_m import small_m_mm
    from kiln.quantization.quantize_kernel import quantize_rows_fp8

    case = make_case([1024], [1], 32, 8, 128, 16, torch.bfloat16)
    assert attention_triton._decode_splits(1, 8, 1024, case.q.device) > attention_triton.MERGE_MAX_SPLITS
    weight, weight_scale = quantize_rows(torch.randn(4096, 4096, device="cuda") * 0.02)

    def step():
        out = attention_triton.paged_attention(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
        q, scale = quantize_rows_fp8(out.reshape(1, 4096))
        return small_m_mm(q, scale.reshape(-1), weight, weight_scale)

    outputs = []
    for small in (False, True):
        monkeypatch.setattr(programmatic_launch, "SMALL_KERNEL_PDL", small)
        outputs.append(replays(step, (case.q, case.k, case.v), 10))
    assert outputs[0].abs().sum() > 0 and torch.equal(outputs[0], outputs[1])
