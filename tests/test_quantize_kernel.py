"""Kiln's Triton kernel for the activations' per-token FP8 quantize (kiln.quantization.quantize_kernel) against the
torch ops it stands for: on the H200, or on the CPU under Triton's interpreter with
``TRITON_INTERPRET=1 python -m pytest -m gpu tests/test_quantize_kernel.py``."""

import importlib.util
import os

import pytest
import torch

from kiln.quantization.activation_quant import FP8, quantize_tokens, silu_mul

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                                  reason="needs a CUDA device or TRITON_INTERPRET=1 with triton")]
# Widths: Llama-3-8B's attention output and MLP (one pass), 70B's MLP (two passes over blocks); small ones for the
# interpreter, one not a power of two, one past the one-pass limit.
WIDTHS = (4096, 14336, 28672) if torch.cuda.is_available() else (96, 1000, 20000)
SUBNORMAL_STEP = 2.0 ** -9  # float8_e4m3fn's spacing below its smallest normal value
# Row counts: one, a few, and (on a GPU) past the SMs' count.
ROWS = (1, 7, 64, 300) if torch.cuda.is_available() else (1, 7, 64)


def assert_same_quantize(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                         exact_share: float) -> None:
    """Scales equal within two bfloat16 steps of the row's largest value; each float8 value within one float8 step
    of the reference's (1/8 of it, or one subnormal step), and at least ``exact_share`` of them equal (the kernel's
    sigmoid is not torch's: a last bit of the largest value moves the scale, and with it a row's values). Under
    Triton's interpreter the casts are not the GPU's round-to-nearest-even: the float8 one drops the carry of a
    mantissa rounded up (a value just under 128 becomes 64, where cvt.rn gives 128), so there a value is held
    within 60% of it and no share equal."""
    (q, scale), (want_q, want_scale) = got, want
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert q.shape == want_q.shape and scale.shape == want_scale.shape
    torch.testing.assert_close(scale, want_scale, rtol=2 * 2.0 ** -7, atol=0)
    values, want_values = q.float() * scale, want_q.float() * want_scale
    share = 0.6 if INTERPRETED else 1 / 8
    assert ((values - want_values).abs() <= want_values.abs() * share + 2 * SUBNORMAL_STEP * want_scale).all()
    if not INTERPRETED:
        assert (q.float() == want_q.float()).float().mean() >= exact_share


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("m", ROWS)
def test_the_kernel_quantizes_as_the_torch_ops(m, width):
    from kiln.quantization.quantize_kernel import quantize_rows_fp8

    torch.manual_seed(width + m)
    x = torch.randn(m, width, device=DEVICE, dtype=torch.bfloat16) * torch.logspace(-2, 1, m, device=DEVICE)[:, None]
    x[0] = 0  # a row of zeros: the smallest scale, zeros out
    got = quantize_rows_fp8(x)
    assert_same_quantize(got, quantize_tokens(x), exact_share=0.99)
    assert (got[0][0].float() == 0).all()
    torch.testing.assert_close(got[1], quantize_tokens(x)[1], rtol=0, atol=0)  # no SiLU: exactly the same


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("m", ROWS)
def test_the_kernel_quantizes_silu_times_up_from_the_merged_product(m, width):
    """gate and up are the two halves of gate/up's merged product, rows strided by twice the width."""
    from kiln.quantization.quantize_kernel import quantize_rows_fp8

    torch.manual_seed(width + m)
    merged = torch.randn(m, 2 * width, device=DEVICE, dtype=torch.bfloat16) * 3
    gate, up = merged[:, :width], merged[:, width:]
    assert_same_quantize(quantize_rows_fp8(gate, up), quantize_tokens(silu_mul(gate, up)), exact_share=0.9)


def test_no_rows_is_no_launch():
    from kiln.quantization.quantize_kernel import quantize_rows_fp8

    q, scale = quantize_rows_fp8(torch.empty(0, 256, device=DEVICE, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and scale.shape == (0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="eager products take the kernel on CUDA only")
def test_an_eager_fp8_product_quantizes_its_input_in_one_kernel():
    """An FP8 product outside a compiled layer (the FP8 head, after the decode graph) quantizes its input with Kiln's
    kernel, one launch where the torch ops are eight, as ``quantize_tokens`` does within the kernel's bound."""
    from torch.profiler import ProfilerActivity, profile

    from kiln.quantization.fp8_linear import fp8_linear, quantize_input, quantize_rows

    torch.manual_seed(0)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    weight, weight_scale = quantize_rows(torch.randn(512, 4096, device="cuda") * 0.02)
    assert_same_quantize(quantize_input(x), quantize_tokens(x), exact_share=0.99)
    fp8_linear(x, weight, weight_scale, None, None)  # the kernels built outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fp8_linear(x, weight, weight_scale, None, None)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_quantize_kernel" in name for name in kernels) == 1 and len(kernels) <= 3, kernels


# Hidden sizes: Llama-3-8B's and 70B's (a program a row holds either), and for the interpreter a small one and one
# not a power of two.
NORM_WIDTHS = (4096, 8192) if torch.cuda.is_available() else (64, 200)


@pytest.mark.parametrize("width", NORM_WIDTHS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("added", [False, True], ids=["norm", "add-and-norm"])
def test_the_norm_kernel_quantizes_as_the_torch_ops(m, width, added):
    """Kiln's RMSNorm-and-quantize kernel against transformers' Llama RMSNorm and the quantize in torch ops; with a
    residual, the sum is the torch add's, bit for bit. Rows of very different sizes: each has its own scale."""
    from kiln.quantization.norm_quantize import rms_norm_quantize_tokens
    from kiln.quantization.norm_quantize_kernel import rms_norm_quantize_rows

    torch.manual_seed(width + m)
    x = torch.randn(m, width, device=DEVICE, dtype=torch.bfloat16) * torch.logspace(-2, 2, m, device=DEVICE)[:, None]
    weight = (torch.rand(width, device=DEVICE) + 0.5).to(torch.bfloat16)
    residual = torch.randn_like(x) if added else None
    q, scale, total = rms_norm_quantize_rows(x, weight, 1e-5, residual)
    want_input = x + residual if added else x
    assert_same_quantize((q, scale), rms_norm_quantize_tokens(want_input, weight, 1e-5), exact_share=0.99)
    if added:
        assert torch.equal(total, want_input)
    else:
        assert total is None


def test_the_norm_ops_run_the_kernel_on_cuda_and_the_torch_ops_elsewhere():
    """The ops take [..., K] (a layer's [1, T, K]) and give rows; the add's sum comes back in x's shape."""
    from kiln.quantization.norm_quantize import add_rms_norm_quantize, rms_norm_quantize, rms_norm_quantize_tokens

    torch.manual_seed(1)
    width = NORM_WIDTHS[0]
    x = torch.randn(1, 5, width, device=DEVICE, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.ones(width, device=DEVICE, dtype=torch.bfloat16)
    q, scale = rms_norm_quantize(x, weight, 1e-6)
    assert q.shape == (5, width) and scale.shape == (5, 1)
    assert_same_quantize((q, scale), rms_norm_quantize_tokens(x, weight, 1e-6), exact_share=0.99)
    q, scale, total = add_rms_norm_quantize(x, residual, weight, 1e-6)
    assert total.shape == x.shape and torch.equal(total, x + residual)
    assert_same_quantize((q, scale), rms_norm_quantize_tokens(x + residual, weight, 1e-6), exact_share=0.99)
