"""The kernel benches that need Triton run: `bench/fp8_gemm.py --check` (its candidates, Kiln's FP8 GEMM among them,
against the dequantized product) and `bench/kernel_sass.py` (Kiln's kernels built for sm_90 and read in SASS).

Both need Triton, which the CPU CI has not: they run with the GPU tests, or on a CPU host with Triton installed as
``TRITON_INTERPRET=1 python -m pytest -m gpu tests/test_bench_kernels.py`` (the SASS bench needs no GPU at all). A
bench that breaks when a kernel's signature changes (as `--check` did when the FP8 GEMM's reduce took a residual) is
found here, not by the next session that needs its figures."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
pytestmark = pytest.mark.gpu


def _run(*args: str, interpret: bool) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["bench", os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                    reason="needs a CUDA device or TRITON_INTERPRET=1 with triton")
def test_the_fp8_gemm_bench_checks_its_candidates():
    out = _run("bench/fp8_gemm.py", "--check", interpret=not torch.cuda.is_available())
    assert "equal to the dequantized product" in out


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its bundled ptxas, nvdisasm and cuobjdump)")
def test_kernel_sass_reads_every_kernel_kiln_builds():
    """Each kernel's row: registers and instructions read from the cubin, and the loops the tree's kernels have (the
    FP8 GEMM's K loop issues its tensor-core dots and asynchronous copies: it is pipelined). The FP8 GEMM asks the
    L2 for its first weight tiles before it waits for the kernel ahead, and the quantize kernels before it release it
    first thing (kiln.programmatic_launch)."""
    out = _run("bench/kernel_sass.py", interpret=False)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([\w-]+) \| \d+ / \d+ \| (\d+) \|.*$", out, re.M)}
    assert set(rows) == {"decode", "decode-fp8", "decode-fp8-one-split", "prefill", "prefill-fp8", "fp8-gemm",
                         "quantize-glu", "norm-quantize-add"}, out
    for row in rows.values():
        registers = int(row.split("|")[3])
        assert 0 < registers <= 255, row
    assert "QGMMA" in rows["fp8-gemm"] and "LDGSTS" in rows["fp8-gemm"], rows["fp8-gemm"]
    for name in ("quantize-glu", "norm-quantize-add"):  # rows read 16 bytes a load
        assert re.search(r"\| \d+x128 \| release \|$", rows[name]), rows[name]
    from kiln.quantization.fp8_small_m import BLOCK_N, prefetched_tiles

    # o's tiles (64 x 256 bytes, 128 lines): a prefetch a thread a tile, PREFETCH_BYTES of them
    tiles = prefetched_tiles(BLOCK_N, 256, 4096)
    assert tiles > 1 and re.search(rf"\| {tiles} prefetch, wait, release \|$", rows["fp8-gemm"]), rows["fp8-gemm"]
    # two of SiLU x up's 1,024-thread programs share an SM's 65,536 registers (quantize_kernel's docstring)
    assert int(rows["quantize-glu"].split("|")[3]) <= 32, rows["quantize-glu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_the_norm_quantize_bench_times_kilns_kernel_and_inductors():
    out = _run("bench/norm_quantize_kernel.py", "--rows", "1,64", "--warps", "8", interpret=False)
    cell = r"[\d.]+ \([\d.]+\)"
    rows = re.findall(rf"^\| (norm|add and norm) \| (\d+) \| {cell} \| {cell} \| \d+ \|$", out, re.M)
    assert sorted(rows) == sorted((case, m) for case in ("norm", "add and norm") for m in ("1", "64")), out
