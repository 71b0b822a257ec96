"""Compile-service figures for one model config: cold piecewise vs full-graph compile, bundle size, cache-hit
time, and a fresh process's load + first forward. Each cold compile runs in its own process with empty
Inductor and Triton caches, so nothing is shared between the two. The JSON also lists the torch and Triton modules
that loading still imported after kiln.bundle.preload_runtime (what preload_runtime should cover).

usage: python bench/compile_times.py [--preset llama-3-8b] [--device cuda] [--dtype bfloat16]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPILE = """
import json, sys, time
from protos import common_pb2
from kiln.model_spec import resolve
from kiln.compile_config import CompileConfig
from kiln.artifact_store import FilesystemStore
from compile_service.pipeline import compile_model
preset, device, dtype, store, full = sys.argv[1:6]
config = common_pb2.CompileConfig(device=device, max_num_batched_tokens=int(sys.argv[6]))
if full == "1":
    config.splitting_ops.SetInParent()
model = resolve(common_pb2.ModelSpec(preset=preset, dtype=dtype), device)
cold = compile_model(model, CompileConfig.from_proto(config), FilesystemStore(store))
hit = compile_model(model, CompileConfig.from_proto(config), FilesystemStore(store))
print(json.dumps({"key": cold.key, "cold_s": cold.total_s, "timings": cold.timings, "bytes": cold.bundle_bytes,
                  "pieces": cold.num_pieces, "hit": hit.cache_hit, "hit_s": hit.total_s}))
"""

LOAD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from pathlib import Path
from protos import common_pb2
from kiln.bundle import load_compiled
from kiln.counters import compile_counts
from kiln.model import build_model
from kiln.model_spec import resolve
preset, device, dtype, path = sys.argv[1:5]
model = build_model(resolve(common_pb2.ModelSpec(preset=preset, dtype=dtype), device), device)
from kiln.bundle import preload_runtime
t = time.perf_counter()
preload_runtime()
imports_s = time.perf_counter() - t
before, modules = compile_counts(), set(sys.modules)
t = time.perf_counter()
fn = load_compiled(Path(path))
load_s = time.perf_counter() - t
imported = sorted(m for m in set(sys.modules) - modules if m.startswith(("torch", "triton")))
ids = torch.randint(0, model.config.vocab_size, (1,), device=device)
t = time.perf_counter()
with torch.no_grad():
    out = fn(model, ids, torch.zeros(1, dtype=torch.long, device=device))
if device == "cuda":
    torch.cuda.synchronize()
first_s = time.perf_counter() - t
delta = compile_counts() - before
print(json.dumps({"imports_s": imports_s, "load_s": load_s, "first_forward_s": first_s,
                  "dynamo_graphs": delta.dynamo_graphs, "inductor_compiles": delta.inductor_compiles,
                  "process_s": time.perf_counter() - t0, "imported_by_load": imported}))
"""


def run(code: str, *args: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fresh_env(tmp: Path, name: str) -> dict:
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp / name / "inductor"),
                         "TRITON_CACHE_DIR": str(tmp / name / "triton"), "PYTHONPATH": python_path}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", default="2048")
    p.add_argument("--variants", default="piecewise,full graph", help="comma-separated: piecewise, full graph")
    p.add_argument("--keep-stores", type=Path, help="write the stores here (store-piecewise/KEY) and keep them")
    args = p.parse_args()
    common = [args.preset, args.device, args.dtype]
    variants = {"piecewise": "0", "full graph": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = {}
        for label in args.variants.split(","):
            full = variants[label]
            store = (args.keep_stores or tmp) / f"store-{label.replace(' ', '-')}"
            rows[label] = run(COMPILE, *common, str(store), full, args.max_num_batched_tokens,
                              env=fresh_env(tmp, f"compile-{full}"))
            key = rows[label]["key"]
            rows[label] |= run(LOAD, *common, str(store / key), env=fresh_env(tmp, f"load-{full}"))
    print(json.dumps(rows, indent=1))
    base = rows.get("full graph", rows[next(iter(rows))])["cold_s"]
    print(f"\n{args.preset} {args.dtype} on {args.device}, {time.strftime('%Y-%m-%d')}")
    print("| variant | pieces | cold compile s | vs full graph | bundle MB | cache hit s | runtime imports s | load s "
          "| first forward s | Dynamo graphs / Inductor compiles at load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['pieces']} | {r['cold_s']:.1f} | {r['cold_s'] / base:.2f}x | {r['bytes'] / 1e6:.1f} | "
              f"{r['hit_s']:.3f} | {r['imports_s']:.2f} | {r['load_s']:.2f} | {r['first_forward_s']:.3f} | "
              f"{r['dynamo_graphs']} / {r['inductor_compiles']} |")


if __name__ == "__main__":
    main()
