"""`bench/start_to_ready.py` on the session's tiny bundle: two fresh `kiln exec-server` processes, cold then warm,
every phase and step reported, and figures that add up."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from conftest import TINY_CONFIG

ROOT = Path(__file__).parents[1]
STEPS = {"fetch": ["verify", "check_factors"], "load_weights": ["build_model"],
         "profile_memory": ["profile_forward", "kv_cache"],
         "load_compiled": ["unpickle", "warm_up", "warm_up_attention"]}


def test_cold_and_warm_start_to_ready_with_every_phase(compile_store, tiny_key, signing_dir, tmp_path):
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, "bench/start_to_ready.py", "--preset", "tiny-llama", "--device", "cpu", "--dtype", "float32",
         "--max-num-batched-tokens", str(TINY_CONFIG.max_compiled_tokens), "--compile-sizes", "8",
         "--store", str(compile_store), "--key", tiny_key, "--trusted-keys", str(signing_dir / "signing.pub"),
         "--no-evict", "--json-out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cold, warm = json.loads(out.read_text())
    assert (cold["label"], warm["label"]) == ("cold", "warm")
    for run in (cold, warm):
        assert list(run["phases"]) == ["fetch", "load_weights", "profile_memory", "load_compiled",
                                       "capture_cudagraphs"]
        assert {phase: list(steps) for phase, steps in run["steps"].items()} == STEPS
        for phase, steps in run["steps"].items():
            assert sum(steps.values()) <= run["phases"][phase] + 1e-3, (phase, steps)
        assert 0 < run["preload_s"] < run["listening_s"]
        assert sum(run["phases"].values()) <= run["load_model_s"]
        assert run["listening_s"] + run["load_model_s"] <= run["ready_s"]
    # Cold: an empty Inductor cache, so the bundle's C++ kernels are built on load; warm: the same cache, found.
    assert warm["steps"]["load_compiled"]["unpickle"] < cold["steps"]["load_compiled"]["unpickle"]
    assert cold["kernels"]["inductor"] > 0 and warm["kernels"] == cold["kernels"]
    table = proc.stdout[proc.stdout.index("| measure | cold s | warm s |"):]
    for row in ("| process start -> listening (imports) |", "|   of which the runtime preload |",
                "| LoadModel: load_compiled |", "|   unpickle |", "| **process start -> ready** |",
                f"| kernels in the caches after the run (Triton cubins / Inductor .so) | 0 / "
                f"{cold['kernels']['inductor']} | 0 / {warm['kernels']['inductor']} |"):
        assert row in table, row
    ready = next(line for line in table.splitlines() if line.startswith("| **process start -> ready**"))
    assert ready == f"| **process start -> ready** | {cold['ready_s']:.2f} | {warm['ready_s']:.2f} |"


def test_page_cache_eviction_asks_about_every_file(tmp_path):
    spec = importlib.util.spec_from_file_location("start_to_ready", ROOT / "bench" / "start_to_ready.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 5000)
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 123)
    (tmp_path / "link").symlink_to(tmp_path / "a.bin")  # not followed: counted once
    assert bench.evict_page_cache([tmp_path]) == 5123
    assert (tmp_path / "a.bin").read_bytes() == b"x" * 5000
