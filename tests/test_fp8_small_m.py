"""Kiln's FP8 GEMM for decode-sized steps (kiln.quantization.fp8_small_m) against the dequantized product, and
torch.ops.kiln.fp8_mm choosing it: on the H200, or on the CPU under Triton's interpreter with
``TRITON_INTERPRET=1 python -m pytest -m gpu tests/test_fp8_small_m.py``."""

import importlib.util
import os

import pytest
import torch
from graph_replays import replays

from kiln.quantization.activation_quant import quantize_tokens
from kiln.quantization.fp8_linear import quantize_rows
from kiln.quantization.fp8_mm import fp8_mm

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                                  reason="needs a CUDA device or TRITON_INTERPRET=1 with triton")]
# (N, K): Llama-3-8B's q/k/v and down on the GPU; small ones the interpreter runs in seconds, one N not a multiple
# of the kernel's 64 rows, one K a multiple of 128 but not 256
SHAPES = ((6144, 4096), (4096, 14336)) if torch.cuda.is_available() else ((96, 512), (40, 384), (128, 1024))
SPLIT_M, MAX_M = 32, 128  # kiln.quantization.fp8_small_m's (it imports Triton, which the CPU CI has not)


# sms: the device's SM count, and as many as make K split 2-8 ways (up to SPLIT_M rows: past them K is not split) or
# the tokens 64 a program (past 64 rows)
@pytest.mark.parametrize("m, sms", [(m, sms) for m in (1, 5, 16, SPLIT_M) for sms in (None, 1024)]
                         + [(48, None), (100, 1024), (MAX_M, None), (MAX_M, 1024)])
@pytest.mark.parametrize("n,k", SHAPES)
def test_small_m_kernel_is_the_dequantized_product(m, n, k, sms, monkeypatch):
    from kiln.quantization import fp8_small_m
    from kiln.quantization.fp8_small_m import small_m_mm

    assert (fp8_small_m.SPLIT_M, fp8_small_m.MAX_M) == (SPLIT_M, MAX_M)
    if sms is not None:
        monkeypatch.setattr(fp8_small_m, "sm_count", lambda device: sms)
        if m <= SPLIT_M:
            assert fp8_small_m.split_k(n, k, 128, sms) > 1 or k % 256  # a K of three 128s splits no way
        else:
            assert fp8_small_m.tokens_a_program(m, n, sms) == 64 < m  # two token tiles, the last one partial at 100
    torch.manual_seed(m)
    q, scale = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.02)
    xq, x_scale = quantize_tokens(torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16))
    want = (xq.float() * x_scale) @ (q.float() * scale[:, None]).t()
    got = small_m_mm(xq, x_scale.reshape(-1).contiguous(), q, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # FP8 tensor cores accumulate with fewer mantissa bits than float32, so the error grows with K: on the H200 the
    # kernel's largest was 1.0% of the outputs' spread at K = 4,096 and 1.7% at 14,336, cuBLASLt's own _scaled_mm
    # 1.0% and 1.2%; bf16's rounding of the largest outputs is of that size too.
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.std().item(), rtol=1e-2)


# Each epilogue: the GEMM's own (one split, all tokens or 64 a program) and the split-K reduce's.
@pytest.mark.parametrize("m, sms", [(1, None), (5, 1024), (100, 1024)])
def test_the_kernel_adds_the_residual(m, sms, monkeypatch):
    """``residual + product`` in the kernel's epilogue equals the float32 sum within the product's own bound and the
    sum's bf16 step (a residual large against the product, so that one left out or added twice cannot pass)."""
    from kiln.quantization import fp8_small_m
    from kiln.quantization.fp8_small_m import small_m_mm

    if sms is not None:
        monkeypatch.setattr(fp8_small_m, "sm_count", lambda device: sms)
    n, k = SHAPES[0]
    torch.manual_seed(m)
    q, scale = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.02)
    xq, x_scale = quantize_tokens(torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16))
    product = (xq.float() * x_scale) @ (q.float() * scale[:, None]).t()
    residual = (torch.randn(m, n, device=DEVICE) * 8 * product.std()).to(torch.bfloat16)
    got = small_m_mm(xq, x_scale.reshape(-1).contiguous(), q, scale, residual)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = residual.float() + product
    bf16_step = want.abs() * 2.0 ** -7  # a step of bf16's 8 significant bits (the interpreter truncates, CUDA rounds)
    assert ((got.float() - want).abs() <= 2e-2 * product.std() + bf16_step).all()


@pytest.mark.parametrize("device_name, shared_bytes, sms", [("H200", 232_448, 132), ("L40S", 101_376, 142)])
def test_the_kernel_takes_decode_sized_products_its_pipeline_fits(device_name, shared_bytes, sms, monkeypatch):
    """Llama-3-8B's shapes: q/k/v (6,144 rows) up to MAX_M rows, gate_up (28,672) up to SPLIT_M, a K not a multiple
    of 128 never; on an Ada's 99 KB of shared memory nothing past 32 rows (the 64-row pipeline needs 128 KB)."""
    from kiln.quantization import fp8_small_m

    monkeypatch.setattr(fp8_small_m, "max_shared_bytes", lambda device: shared_bytes)
    monkeypatch.setattr(fp8_small_m, "sm_count", lambda device: sms)
    cuda = torch.device("cuda")
    taken = {(m, n, k) for m in (1, SPLIT_M, SPLIT_M + 1, 64, MAX_M, MAX_M + 1) for n, k in
             ((6144, 4096), (28672, 4096), (4096, 14336), (6144, 4160)) if fp8_small_m.takes(m, n, k, cuda)}
    small = {(m, n, k) for m in (1, SPLIT_M) for n, k in ((6144, 4096), (28672, 4096), (4096, 14336))}
    if device_name == "H200":
        assert taken == small | {(m, n, k) for m in (SPLIT_M + 1, 64, MAX_M) for n, k in ((6144, 4096), (4096, 14336))}
    else:
        assert taken == small


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op picks the kernel on CUDA only")
def test_fp8_mm_takes_the_kernel_for_decode_sized_steps_and_scaled_mm_past_them(monkeypatch):
    """Llama-3-8B's q/k/v (6,144 rows: 48 of cuBLASLt's tiles) in Kiln's kernel up to MAX_M rows; its gate_up
    (28,672 rows: 224 tiles, more than the H200's 132 SMs) only up to SPLIT_M."""
    from kiln.quantization import fp8_small_m

    calls = []
    kernel = fp8_small_m.small_m_mm
    monkeypatch.setattr(fp8_small_m, "small_m_mm", lambda *args: calls.append((args[2].shape[0], args[0].shape[0]))
                        or kernel(*args))
    for n, k, rows in ((6144, 4096, (1, SPLIT_M, SPLIT_M + 1, MAX_M, MAX_M + 1)), (28672, 4096, (SPLIT_M, 64))):
        q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        for m in rows:
            xq, x_scale = quantize_tokens(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            # The dequantized product: cuBLASLt's fast accumulation is within bf16 rounding of it too.
            want = (xq.float() * x_scale) @ (q.float() * scale[:, None]).t()
            torch.testing.assert_close(fp8_mm(xq, x_scale, q, scale, torch.bfloat16).float(), want,
                                       atol=1e-2, rtol=1e-2)
    assert calls == [(6144, 1), (6144, SPLIT_M), (6144, SPLIT_M + 1), (6144, MAX_M), (28672, SPLIT_M)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90 or later")
@pytest.mark.parametrize("m", [1, SPLIT_M])
def test_programmatic_launch_changes_no_bit_of_an_mlp_chain_in_a_cuda_graph(m, monkeypatch):
    """Llama-3-8B's MLP as the decode graph runs it (the residual add, RMSNorm and quantize, gate/up, SiLU x up
    quantize, down), two layers' of it, replayed from CUDA graphs captured without programmatic dependent launch,
    with it, with it and the weight prefetch (the quantize kernels releasing the GEMM after them first thing), and
    with the norm kernel launched with PDL too, each input written just before the replay: a kernel reading its input
    before the one that writes it has ended would differ. The kernel sees 1,024 SMs, so that down splits K and its
    reduce runs in the chain too.
    """
    from kiln import programmatic_launch
    from kiln.quantization import fp8_small_m
    from kiln.quantization.fp8_small_m import small_m_mm
    from kiln.quantization.norm_quantize_kernel import rms_norm_quantize_rows
    from kiln.quantization.quantize_kernel import quantize_rows_fp8

    monkeypatch.setattr(fp8_small_m, "sm_count", lambda device: 1024)
    assert fp8_small_m.split_k(4096, 14336, 256, 1024) > 1

    torch.manual_seed(0)
    gate_up, gate_up_scale = quantize_rows(torch.randn(28672, 4096, device="cuda") * 0.02)
    down, down_scale = quantize_rows(torch.randn(4096, 14336, device="cuda") * 0.02)
    norm = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    x, residual = (torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def layer(hidden, res):
        xq, x_scale, total = rms_norm_quantize_rows(hidden, norm, 1e-5, res)
        h = small_m_mm(xq, x_scale.reshape(-1), gate_up, gate_up_scale)
        hq, h_scale = quantize_rows_fp8(h[:, :14336], h[:, 14336:])
        return small_m_mm(hq, h_scale.reshape(-1), down, down_scale, total), total

    def mlp():  # two layers' MLPs: the second's norm starts while the first's down ends
        return layer(*layer(x, residual))[0]

    outputs = []
    for pdl, prefetch, small in ((False, 0, False), (True, 0, False), (True, 256 * 1024, False),
                                 (True, 256 * 1024, True)):
        monkeypatch.setattr(programmatic_launch, "ENABLED", pdl)
        monkeypatch.setattr(programmatic_launch, "PREFETCH_BYTES", prefetch)
        monkeypatch.setattr(programmatic_launch, "SMALL_KERNEL_PDL", small)
        outputs.append(replays(mlp, (x, residual), 20))
    first, *others = outputs
    assert first.abs().sum() > 0
    assert all(torch.equal(first, other) for other in others)
