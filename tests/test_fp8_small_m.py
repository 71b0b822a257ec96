"""Kiln's FP8 GEMM for decode-sized steps (kiln.quantization.fp8_small_m) against the dequantized product, and
torch.ops.kiln.fp8_mm choosing it: on the H200, or on the CPU under Triton's interpreter with
``TRITON_INTERPRET=1 python -m pytest -m gpu tests/test_fp8_small_m.py``."""

import importlib.util
import os

import pytest
import torch

from kiln.quantization.fp8_linear import quantize_rows, quantize_tokens
from kiln.quantization.fp8_mm import SMALL_M, fp8_mm

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                                  reason="needs a CUDA device or TRITON_INTERPRET=1 with triton")]
# (N, K): Llama-3-8B's q/k/v and down on the GPU; small ones the interpreter runs in seconds, one N not a multiple
# of the kernel's 64 rows, one K a multiple of 128 but not 256
SHAPES = ((6144, 4096), (4096, 14336)) if torch.cuda.is_available() else ((96, 512), (40, 384), (128, 1024))


@pytest.mark.parametrize("m", [1, 5, 16, SMALL_M])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("sms", [None, 256])  # the device's SM count, and as many as make K split 2-8 ways
def test_small_m_kernel_is_the_dequantized_product(m, n, k, sms, monkeypatch):
    from kiln.quantization import fp8_small_m
    from kiln.quantization.fp8_small_m import small_m_mm

    if sms is not None:
        monkeypatch.setattr(fp8_small_m, "_num_sms", lambda device: sms)
        assert fp8_small_m.split_k(n, k, 128, sms) > 1 or k % 256  # a K of three 128s splits no way
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op picks the kernel on CUDA only")
def test_fp8_mm_takes_the_kernel_up_to_small_m_rows_and_scaled_mm_past_them(monkeypatch):
    from kiln.quantization import fp8_small_m

    n, k = SHAPES[0]
    q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    calls = []
    kernel = fp8_small_m.small_m_mm
    monkeypatch.setattr(fp8_small_m, "small_m_mm", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    for m in (1, SMALL_M, SMALL_M + 1):
        xq, x_scale = quantize_tokens(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        # The dequantized product: past SMALL_M, cuBLASLt's fast accumulation is within bf16 rounding of it.
        want = (xq.float() * x_scale) @ (q.float() * scale[:, None]).t()
        torch.testing.assert_close(fp8_mm(xq, x_scale, q, scale, torch.bfloat16).float(), want,
                                   atol=1e-2, rtol=1e-2)
    assert calls == [1, SMALL_M]
