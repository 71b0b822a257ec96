"""Programmatic dependent launch (Hopper and later) for Kiln's FP8 GEMM.

A decode layer at batch 1 is ~20 kernels of 1–20 µs, each started only once the one before it has ended, its
launch and prologue on the critical path. Launched with ``launch_pdl``, a kernel starts while the one before it
finishes; it reads and writes nothing until ``gdc_wait`` returns (the earlier kernel complete, its writes visible),
and lets the next kernel start with ``gdc_launch_dependents``, only ever after its own wait: so a kernel that has
started may read what every kernel two or more back wrote, which Inductor's kernels under its ``triton.enable_pdl``
option assume too. On an H100 the FP8 GEMM and its reduce launched so took the 8B decode step from 3.86 / 4.27 /
5.65 to 3.67 / 4.08 / 5.44 ms at batch 1 / 8 / 32 (BENCHMARKS.md). The quantize kernel launched so made batch 8 and 32
slower, the decode attention's kernels gained nothing: they launch as before.

What a GEMM reads that no kernel writes, its weight, it may read before its wait. Kiln's quantize kernels, which
write the GEMMs' inputs, let the GEMM after them start as they start (they themselves launch without PDL, so they
begin once the kernel before has ended, and the GEMM still reads what they write only after its wait; under
SMALL_KERNEL_PDL the 8-warp ones launch with PDL too and wait before they read, so the GEMM may start while the kernel
two back ends, and reads nothing of it before its own wait): the GEMM's programs ask the L2 for the first tiles of
their weight rows (``prefetch_l2``) while the quantize runs, so that the HBM streams weights during the small kernels
of a decode layer (at batch 1 on the H200 the quantize and norm kernels take ~10 µs of the layer's 87; BENCHMARKS.md).
On an H100 it took the step from 3.52 / 3.88 / 5.12 to 3.40 / 3.75 / 5.03 ms at batch 1 / 8 / 32; 256 KB a program
gained nothing.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.multiprocessors import sm_count

ENABLED = True  # bench/forward_latency.py --no-kernel-pdl turns it off, to measure what it gives
# Weight bytes each program of Kiln's GEMM asks the L2 for before its wait; 0: none, and the quantize kernels release
# the GEMM only as they end (bench/forward_latency.py --weight-prefetch-kb)
PREFETCH_BYTES = 128 * 1024
# Whether Kiln's quantize kernels of few warps launch with PDL themselves, starting while the GEMM before them ends
# (off: the SiLU x up quantize's 32 warps launched so made batch 8 and 32 slower; the norm and attention-output
# quantizes' 8, bench/forward_latency.py --small-kernel-pdl, were no faster than the prefetch alone on an H100). A
# kernel they release then may start before the one two back has ended: Kiln's GEMM reads nothing of it before its
# wait, but an Inductor kernel under ``triton.enable_pdl`` assumes otherwise, so the two are not for one bundle.
SMALL_KERNEL_PDL = False
SMALL_KERNEL_MAX_WARPS = 8


@functools.cache
def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether Kiln's GEMM launches on ``device`` with programmatic dependent launch: CUDA on sm_90 or later."""
    return ENABLED and device.type == "cuda" and _capable(device)


def leads(programs: int, device: torch.device) -> bool:
    """Whether a quantize kernel of ``programs`` programs lets the GEMM after it start as it starts: with programmatic
    launch and the weight prefetch on, where its programs all run at once (a decode step's rows), so that no program
    of the GEMM takes an SM one of its own still waits for."""
    return enabled(device) and PREFETCH_BYTES > 0 and programs <= sm_count(device)


def follows(programs: int, warps: int, device: torch.device) -> bool:
    """Whether a quantize kernel of ``programs`` programs of ``warps`` warps launches with PDL itself: where
    SMALL_KERNEL_PDL asks, its programs all run at once and are at most SMALL_KERNEL_MAX_WARPS wide. It waits for the
    kernel before it before it reads anything."""
    return SMALL_KERNEL_PDL and enabled(device) and warps <= SMALL_KERNEL_MAX_WARPS and programs <= sm_count(device)


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
def prefetch_l2(ptrs):
    """Ask the L2 for the lines at ``ptrs`` (a tensor of global pointers, any value in each 128-byte line) and go on:
    nothing waits for them, and a later load of those bytes finds them in the L2 or already on their way."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
