"""Programmatic dependent launch (Hopper and later) for Kiln's FP8 GEMM.

A decode layer at batch 1 is ~20 kernels of 1–20 µs, each started only once the one before it has ended, its
launch and prologue on the critical path. Launched with ``launch_pdl``, a kernel starts while the one before it
finishes; it reads and writes nothing until ``gdc_wait`` returns (the earlier kernel complete, its writes visible),
and lets the next kernel start with ``gdc_launch_dependents``, only ever after its own wait: so a kernel that has
started may read what every kernel two or more back wrote, which Inductor's kernels under its ``triton.enable_pdl``
option assume too. On an H100 the FP8 GEMM and its reduce launched so took the 8B decode step from 3.86 / 4.27 /
5.65 to 3.67 / 4.08 / 5.44 ms at batch 1 / 8 / 32 (BENCHMARKS.md). The quantize kernel launched so made batch 8 and 32
slower, the decode attention's kernels gained nothing: they launch as before.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # bench/forward_latency.py --no-kernel-pdl turns it off, to measure what it gives


@functools.cache
def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether Kiln's GEMM launches on ``device`` with programmatic dependent launch: CUDA on sm_90 or later."""
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
