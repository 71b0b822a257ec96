"""Inductor's and Triton's on-disk caches, partitioned by what torch's own cache keys leave out.

Inductor's FX graph cache key has no CPU ISA: a compile with ``ATEN_CPU_CAPABILITY=avx2`` found the AVX-512 code that
an earlier compile left in the same cache, and the model it served generated NaN tokens. Kiln's key is right (the ISA
is one of its factors), so the fix is below it: each compile uses ``kiln-<partition>`` subdirectories of the
configured cache directories, one per value of the factors torch misses.
"""

import hashlib
import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTITION_FILE = "kiln-partition.json"


def partition_factors(device: str) -> dict:
    """What this process's generated code for ``device`` depends on that Inductor's and Triton's keys do not hold.

    The vector ISA Inductor's C++ code is built for counts for CPU code only: finding it compiles a test program
    per ISA (25 s of a cold compile on the H200 machine), and a CUDA compile's kernels are Triton's. Torch keeps the
    answer per process; it is nearly all of a CPU cache-hit load's ``bundle_key`` step, and remembering it across
    processes would gain nothing, because loading the CPU code probes it again when the key did not
    (BENCHMARKS.md, "bundle_key on a cache hit")."""
    import torch

    factors = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # follows ATEN_CPU_CAPABILITY
        "machine": platform.machine(),
    }
    if device == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        factors["inductor_vec_isa"] = str(pick_vec_isa())  # what Inductor's C++ codegen vectorizes for
    return factors


def partition_name(factors: dict) -> str:
    canonical = json.dumps(factors, sort_keys=True)
    return "kiln-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


@contextmanager
def partitioned_caches(device: str) -> Iterator[Path]:
    """Point Inductor and Triton at this process's partition for the duration; yields the Inductor directory.

    Sets the environment variables torch and Triton read on every lookup, so it must not overlap another compile
    in the same process (the compile pipeline holds its compile lock around it).
    """
    from torch._inductor import utils as inductor_utils
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    factors = partition_factors(device)
    name = partition_name(factors)
    saved = {var: os.environ.get(var) for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    inductor_dir = Path(saved["TORCHINDUCTOR_CACHE_DIR"] or default_cache_dir()).absolute() / name
    triton_dir = Path(saved["TRITON_CACHE_DIR"]) / name if saved["TRITON_CACHE_DIR"] else inductor_dir / "triton"
    inductor_dir.mkdir(parents=True, exist_ok=True)
    (inductor_dir / PARTITION_FILE).write_text(json.dumps(factors, indent=1, sort_keys=True))
    clear_caches = getattr(inductor_utils, "clear_caches", None) or inductor_utils.clear_inductor_caches
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    os.environ["TRITON_CACHE_DIR"] = str(triton_dir)
    clear_caches()  # paths torch memoized from the previous directory
    try:
        yield inductor_dir
    finally:
        clear_caches()
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
