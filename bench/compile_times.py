"""Compile-service figures for one model config: cold compile (each kind of decoder layer once, split at attention
or whole), how it scales with the number of layers, bundle size, cache-hit time, and a fresh process's load + first
forward.

Each cold compile runs in its own process with empty Inductor and Triton caches, so nothing is shared between rows.
A row per variant and layer count: ``--num-layers 32,1`` puts the model beside its one-layer version, which is what
the cold compile should cost now that the decoder layer is compiled once and run for every layer. The Dynamo graphs
and Inductor compiles of the cold compile are counted (they must not grow with the layers), and so are those of the
load (they must be 0). The JSON also lists the torch and Triton modules that loading still imported after
kiln.store.bundle.preload_runtime (what preload_runtime should cover).

usage: python bench/compile_times.py [--preset llama-3-8b] [--device cuda] [--dtype bfloat16] [--num-layers 32,1]
                                     [--compile-sizes 1,8,32] [--inductor-config '{"coordinate_descent_tuning": true}']
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
from kiln.model.spec import resolve
from kiln.compilation.config import CompileConfig
from kiln.store.artifact_store import FilesystemStore
from kiln.compilation.counters import compile_counts
from kiln.store.signing import Signer, TrustedKeys
from compile_service.pipeline import compile_model
spec, device, store, config_json, keys = sys.argv[1:6]
config = common_pb2.CompileConfig()
config.ParseFromString(bytes.fromhex(config_json))
model = resolve(common_pb2.ModelSpec.FromString(bytes.fromhex(spec)), device)
signer, trusted = Signer.load(keys + "/signing.key"), TrustedKeys.load(keys + "/signing.pub")
store = FilesystemStore(store, signer=signer, trusted=trusted)
before = compile_counts()
cold = compile_model(model, CompileConfig.from_proto(config), store)
counts = compile_counts() - before
hit = compile_model(model, CompileConfig.from_proto(config), store)
print(json.dumps({"key": cold.key, "cold_s": cold.total_s, "timings": cold.timings, "bytes": cold.bundle_bytes,
                  "pieces": cold.num_pieces, "compile_dynamo_graphs": counts.dynamo_graphs,
                  "compile_inductor_compiles": counts.inductor_compiles, "hit": hit.cache_hit, "hit_s": hit.total_s}))
"""

LOAD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from pathlib import Path
from protos import common_pb2
from kiln.store.bundle import load_compiled
from kiln.compilation.counters import compile_counts
from kiln.model.causal_lm import build_model
from kiln.model.spec import resolve
from kiln.store.signing import TrustedKeys
spec, device, path, keys, quantization = sys.argv[1:6]
model = build_model(resolve(common_pb2.ModelSpec.FromString(bytes.fromhex(spec)), device), device,
                    quantization=quantization)
from kiln.store.bundle import preload_runtime
t = time.perf_counter()
preload_runtime()
imports_s = time.perf_counter() - t
before, modules = compile_counts(), set(sys.modules)
t = time.perf_counter()
fn = load_compiled(Path(path), Path(path).name, TrustedKeys.load(keys + "/signing.pub"))
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


def model_spec(preset: str, dtype: str, layers: int | None) -> str:
    """The preset, or its config with ``layers`` decoder layers, as a hex-encoded ModelSpec for the child."""
    from kiln.model.presets import PRESETS
    from protos import common_pb2

    if layers is None:
        return common_pb2.ModelSpec(preset=preset, dtype=dtype).SerializeToString().hex()
    config = PRESETS[preset] | {"num_hidden_layers": layers}
    return common_pb2.ModelSpec(config_json=json.dumps(config), dtype=dtype).SerializeToString().hex()


def compile_config(args: argparse.Namespace, full_graph: bool) -> str:
    from kiln.client.requests import compile_config as build

    config = build(args.device, [int(s) for s in args.compile_sizes.split(",") if s], int(args.max_compiled_tokens),
                   () if full_graph else None, args.inductor_config, args.quantization)
    return config.SerializeToString().hex()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-compiled-tokens", "--max-num-batched-tokens", dest="max_compiled_tokens", default="2048",
                   help="the compiled token range")
    p.add_argument("--variants", default="piecewise,full graph",
                   help="comma-separated: piecewise (a layer split at attention), full graph (a layer whole)")
    p.add_argument("--num-layers", default="",
                   help="comma-separated decoder layer counts to compile the preset with; '' is the preset's own")
    p.add_argument("--compile-sizes", default="", help="comma-separated static token counts, e.g. 1,8,32")
    p.add_argument("--inductor-config", default="", help='Inductor patches as JSON, e.g. {"max_autotune": true}')
    p.add_argument("--quantization", default="", choices=["", "fp8"], help="fp8: the decoder's linears in FP8")
    p.add_argument("--keep-stores", type=Path, help="write the stores here (store-piecewise-L32/KEY) and keep them")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    layer_counts = [int(n) if n else None for n in args.num_layers.split(",")]
    variants = {"piecewise": False, "full graph": True}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from kiln.store.signing import generate_key_pair

        # The bundles are signed, and checked at load; kept stores keep their keys beside them.
        keys = str(generate_key_pair((args.keep_stores or tmp) / "keys")[0].parent)
        for label in args.variants.split(","):
            for layers in layer_counts:
                name = f"{label.replace(' ', '-')}-L{layers or 'preset'}"
                spec = model_spec(args.preset, args.dtype, layers)
                store = (args.keep_stores or tmp) / f"store-{name}"
                row = run(COMPILE, spec, args.device, str(store), compile_config(args, variants[label]), keys,
                          env=fresh_env(tmp, f"compile-{name}"))
                row |= run(LOAD, spec, args.device, str(store / row["key"]), keys, args.quantization,
                           env=fresh_env(tmp, f"load-{name}"))
                rows[(label, layers)] = row | {"variant": label, "layers": layers}
    print(json.dumps(list(rows.values()), indent=1))
    print(f"\n{args.preset} {args.dtype} on {args.device}, sizes [{args.compile_sizes}] "
          f"{args.inductor_config}, {time.strftime('%Y-%m-%d')}")
    print("| variant | layers | pieces | Dynamo graphs / Inductor compiles, cold | cold compile s | trace s | "
          "inductor s | key + build + examples s | untimed s | vs fewest layers | bundle MB | cache hit s | "
          "runtime imports s | load s | first forward s | Dynamo graphs / Inductor compiles at load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (label, layers), r in rows.items():
        fewest = rows[(label, min(layer_counts, key=lambda n: n if n is not None else 1 << 30))]["cold_s"]
        timings = r["timings"]
        setup = sum(timings.get(phase, 0) for phase in ("key", "build", "examples"))
        print(f"| {label} | {layers or 'preset'} | {r['pieces']} | {r['compile_dynamo_graphs']} / "
              f"{r['compile_inductor_compiles']} | {r['cold_s']:.1f} | {timings.get('trace', 0):.1f} | "
              f"{timings.get('inductor', 0):.1f} | {setup:.1f} | {r['cold_s'] - sum(timings.values()):.1f} | "
              f"{r['cold_s'] / fewest:.2f}x | {r['bytes'] / 1e6:.1f} | "
              f"{r['hit_s']:.3f} | {r['imports_s']:.2f} | {r['load_s']:.2f} | {r['first_forward_s']:.3f} | "
              f"{r['dynamo_graphs']} / {r['inductor_compiles']} |")


if __name__ == "__main__":
    main()
