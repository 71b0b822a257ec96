"""KV blocks from a memory profile on the eager model (what Kiln does) against one on the compiled model.

Both profiles run the same forward at --tokens tokens plus the logits of --rows rows, measure the peak above the
weights, and size the cache with the execute service's own formula (exec_service.startup.kv_sizing.cuda_budget).

usage: python bench/kv_blocks.py --bundle STORE/KEY [--preset llama-3-8b] [--tokens 2048]
"""

import argparse
import time
from pathlib import Path

import torch

from exec_service.engine import kv_cache
from exec_service.startup import kv_sizing
from kiln.bundle import load_compiled
from kiln.model import build_model, weights_bytes
from kiln.model_spec import resolve
from kiln.signing import TrustedKeys, local_keys_dir
from protos import common_pb2


def peak_bytes(forward, model, tokens: int, rows: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    hidden = forward(torch.zeros(tokens, dtype=torch.int64, device="cuda"), torch.arange(tokens, device="cuda"))
    model.logits(hidden[:rows])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--trusted-keys", type=Path, help="public key(s) the bundle must be signed by (default: the key "
                   "pair kept beside its store, as kiln demo and kiln bench keep it)")
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--utilization", type=float, default=0.9)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    resolved = resolve(common_pb2.ModelSpec(preset=args.preset, dtype="bfloat16"), "cuda")
    model = build_model(resolved, "cuda")
    spec = kv_cache.KVCacheSpec.from_config(resolved.config, 16, resolved.dtype)
    eager_peak = peak_bytes(model, model, args.tokens, args.rows)
    compiled = load_compiled(args.bundle, args.bundle.name, TrustedKeys.load(
        args.trusted_keys or local_keys_dir(args.bundle.parent)))
    compiled_peak = peak_bytes(lambda ids, pos: compiled(model, ids, pos), model, args.tokens, args.rows)
    rows = []
    for label, peak in (("eager (Kiln)", eager_peak), ("compiled", compiled_peak)):
        budget = kv_sizing.cuda_budget(args.utilization, weights_bytes(model), peak, kv_sizing.CUDAGRAPH_RESERVE_BYTES,
                                       0, torch.device("cuda"))
        rows.append((label, peak, budget.kv_cache_bytes // spec.block_bytes))
    print(f"\n{args.preset} bf16, profile at {args.tokens} tokens, utilization {args.utilization}, "
          f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
    print("| profiled on | activation peak GiB | KV blocks (16 tokens) | vs eager |")
    print("|---|---|---|---|")
    for label, peak, blocks in rows:
        print(f"| {label} | {peak / (1 << 30):.2f} | {blocks} | {blocks / rows[0][2]:.3f}x |")


if __name__ == "__main__":
    main()
