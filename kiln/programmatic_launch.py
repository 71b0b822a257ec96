"""Programmatic dependent launch (Hopper and later) for Kiln's Triton kernels.

A decode layer at batch 1 is ~20 kernels of 1–20 µs, each started only once the one before it has ended, its
launch and prologue on the critical path. Launched with ``launch_pdl``, a kernel starts while the one before it
finishes; it reads nothing that one writes until ``gdc_wait`` returns (the earlier kernel complete, its writes
visible), and it lets the next kernel start by ``gdc_launch_dependents``. Until the wait a kernel may only touch
what no earlier kernel writes: the GEMM prefetches its weight into L2 there. Inductor's own kernels do the same
with its ``triton.enable_pdl`` option, and assume what Kiln's kernels keep: a kernel lets the next one start only
after its own wait, so any kernel that has started may read what every kernel two or more back wrote.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # bench/forward_latency.py --no-kernel-pdl turns it off to measure what it gives


@functools.cache
def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch: CUDA on sm_90 or later."""
    return ENABLED and device.type == "cuda" and _capable(device)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before to end, its writes visible (nothing without PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel start (nothing without PDL). A kernel of many programs calls it once its main loop is
    done: released at its start, the next kernel's programs would take SMs its later programs still need."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """``wait`` then ``release``, for a small kernel that the next may overlap whole."""
    wait(PDL)
    release(PDL)


@triton.jit
def prefetch_l2(ptrs, nbytes, mask):
    """Ask L2 to fetch ``nbytes`` (a multiple of 16) from each 16-byte aligned address of ``ptrs`` where ``mask``:
    one bulk prefetch each, which returns at once and loads nothing into registers."""
    addresses = tl.where(mask, ptrs.to(tl.int64), 0)
    sizes = tl.zeros_like(addresses).to(tl.int32) + nbytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s64 p, $1, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addresses, sizes], dtype=tl.int32, is_pure=False, pack=1)
