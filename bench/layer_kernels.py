"""What one decode step's time is made of: the GPU kernels of Kiln's compiled forward, replayed from its CUDA graph,
per decoder layer, at a few batch sizes, each against the layer's share of the memory-bandwidth floor.

A kernel is a layer's when it runs a multiple of num_hidden_layers times per step; the rest (embedding, final norm,
the head and the logits) is listed once per step, and so is a kernel the layers share with the rest (with
--quantize-head the head's FP8 GEMM is Kiln's kernel too: its 4 x 32 + 1 calls are not a layer's, so time the layers
without it). The floor of a layer is its weight bytes plus the KV bytes its
attention reads, over the copy bandwidth measured in this run. With --prefill-tokens N the table gains one
prefill step of N tokens from scratch (compiled, launched from Python, as a chunk past the mixed graphs runs):
compute-bound, so it has no bandwidth floor.

usage: python bench/layer_kernels.py --bundle STORE/KEY [--trusted-keys KEYS] [--preset llama-3-8b]
                                     [--batch-sizes 1,8,32] [--prefill-tokens 2048] [--quantization fp8]
                                     [--kv-cache-dtype fp8_e4m3] [--json-out FILE]
"""

import json
import re
import time
from collections import defaultdict

import torch
from forward_latency import (
    BLOCK_SIZE,
    copy_bandwidth,
    decode_bench_args,
    decode_metadata,
    fill_step_buffers,
    load_for_decode,
    prefill_step,
)

from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
from exec_service.engine.step_inputs import StepBuffers
from kiln.compilation.counters import expect_no_compile
from kiln.model.causal_lm import weights_bytes

STEPS = 20  # replays profiled per batch size


def kind_of(name: str) -> str:
    """A kernel's role, from the names cuBLAS, Inductor and Kiln's attention, quantize and FP8 GEMM kernels give them.
    Inductor's names list the ops fused in them (an FP8 product's input quantize brings "fp8_mm" into a norm's), so
    they are read first; Kiln's decode reduce is attention, its split-K ``reduce_kernel`` a GEMM's."""
    lowered = name.lower()
    if lowered.startswith("triton_red") or lowered.startswith("triton_per"):
        return "reduction (norm) fusion"
    if lowered.startswith("triton_poi"):
        return "pointwise fusion"
    if "attention" in lowered or "decode" in lowered or "prefill" in lowered or "kv_" in lowered:
        return "attention (Kiln)"
    if re.search(r"gemm|gemv|nvjet|cutlass|xmma|sm90|splitk|matmul|mm_|swap_ab|^reduce_kernel", lowered):
        return "GEMM"
    if "quantize" in lowered:
        return "quantize (Kiln)"
    if "memcpy" in lowered or "memset" in lowered or "copy" in lowered:
        return "copy"
    return "other"


def profile_step(replay, steps: int) -> dict[str, tuple[int, float]]:
    """Kernel name -> (calls per step, µs per step), from the profiler's CUDA kernel events."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    return {name: (calls // steps, us / steps) for name, (calls, us) in totals.items()}


def layer_table(kernels: dict[str, tuple[int, float]], layers: int) -> tuple[list[dict], list[dict]]:
    """Per-layer kernels (name, calls per layer, µs per layer) and the step's other kernels (name, calls, µs)."""
    per_layer, rest = [], []
    for name, (calls, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        if calls and calls % layers == 0:
            per_layer.append({"kernel": name, "kind": kind_of(name), "calls": calls // layers, "us": us / layers})
        else:
            rest.append({"kernel": name, "kind": kind_of(name), "calls": calls, "us": us})
    return per_layer, rest


def main() -> None:
    args, sizes = decode_bench_args("1,8,32")
    setup = load_for_decode(args, sizes)
    model, compiled = setup.model, setup.compiled
    config = setup.resolved.config
    layers = config.num_hidden_layers
    bandwidth = copy_bandwidth()
    layer_weight_bytes = weights_bytes(model.causal_lm.base_model.layers[0])
    buffers = StepBuffers(max(sizes), max(sizes), setup.max_blocks, BLOCK_SIZE, config.vocab_size, "cuda",
                          setup.spec.num_kv_heads)
    graphs = CUDAGraphs(lambda ids, pos: compiled(model, ids, pos), tuple(sizes), buffers, buffers.graph_metadata,
                        config.hidden_size, setup.resolved.dtype, torch.device("cuda"))
    with expect_no_compile("capturing"):
        graphs.capture(setup.caches, kv_scales=setup.scales)

    report = {"preset": args.preset, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "bandwidth": bandwidth, "weights_bytes": weights_bytes(model), "layer_weight_bytes": layer_weight_bytes,
              "quantization": args.quantization, "sizes": {}}
    for bs in sizes:
        meta = decode_metadata(bs, args.context, setup.max_blocks)
        fill_step_buffers(buffers, torch.randint(0, config.vocab_size, (bs,), device="cuda"),
                          torch.full((bs,), args.context, dtype=torch.int64, device="cuda"), meta)
        padded = graphs.padded_size(bs)
        kernels = profile_step(lambda padded=padded, bs=bs: model.logits(graphs.replay(padded)[:bs]), STEPS)
        per_layer, rest = layer_table(kernels, layers)
        kv_layer = bs * (args.context + 1) * setup.spec.block_bytes // BLOCK_SIZE // layers
        floor_us = (layer_weight_bytes + kv_layer) / bandwidth * 1e6
        report["sizes"][bs] = {"layer_floor_us": floor_us, "per_layer": per_layer, "rest": rest,
                               "layer_us": sum(k["us"] for k in per_layer), "rest_us": sum(k["us"] for k in rest)}
        print(json.dumps({"batch_size": bs, "layer_floor_us": floor_us,
                          "layer_us": report["sizes"][bs]["layer_us"]}), flush=True)
    if args.prefill_tokens:
        kernels = profile_step(prefill_step(model, compiled, args.prefill_tokens, config.vocab_size, setup.spec), 5)
        per_layer, rest = layer_table(kernels, layers)
        report["sizes"][f"prefill {args.prefill_tokens}"] = {
            "layer_floor_us": None, "per_layer": per_layer, "rest": rest,
            "layer_us": sum(k["us"] for k in per_layer), "rest_us": sum(k["us"] for k in rest)}
    print_tables(report)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


def size_label(size) -> str:
    return f"bs {size}" if isinstance(size, int) else size


def print_tables(report: dict) -> None:
    sizes = list(report["sizes"])
    print(f"\n{report['preset']} {report['quantization'] or 'bf16'}, one decoder layer, {report['device']}, "
          f"{report['date']}; copy bandwidth "
          f"{report['bandwidth'] / 1e12:.2f} TB/s, layer weights {report['layer_weight_bytes'] / 1e6:.1f} MB")
    print("| kernel | kind | calls/layer | " + " | ".join(f"{size_label(bs)} µs (% of floor)" for bs in sizes) + " |")
    print("|---|---|---|" + "---|" * len(sizes))
    names: dict[str, dict] = {}
    for bs in sizes:
        for k in report["sizes"][bs]["per_layer"]:
            names.setdefault(k["kernel"], {"kind": k["kind"], "calls": k["calls"]})[bs] = k["us"]
    for name, row in names.items():
        cells = []
        for bs in sizes:
            us, floor = row.get(bs), report["sizes"][bs]["layer_floor_us"]
            cells.append("–" if us is None else f"{us:.1f}" if floor is None else f"{us:.1f} ({100 * us / floor:.0f}%)")
        print(f"| `{name[:70]}` | {row['kind']} | {row['calls']} | " + " | ".join(cells) + " |")
    totals = []
    for bs in sizes:
        s = report["sizes"][bs]
        floor = s["layer_floor_us"]
        totals.append(f"{s['layer_us']:.1f}" if floor is None else
                      f"{s['layer_us']:.1f} / {floor:.1f} = {s['layer_us'] / floor:.2f}x")
    print("| **layer total / floor** | | | " + " | ".join(totals) + " |")
    print("| rest of the step (embedding, final norm, head) µs | | | "
          + " | ".join(f"{report['sizes'][bs]['rest_us']:.1f}" for bs in sizes) + " |")


if __name__ == "__main__":
    main()
