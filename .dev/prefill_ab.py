"""Experiment: a 2,048-token prefill step of a bundle, the prefill kernel's variants A/B, launched and from a graph,
with the graph replay's kernel sum from the profiler."""
import sys
sys.path.insert(0, "bench")
import torch
from forward_latency import decode_bench_args, load_for_decode, prefill_step, time_ms
from layer_kernels import profile_step
from kiln.attention import triton_kernels as tk

args, sizes = decode_bench_args("1")
resolved, model, spec, caches, compiled, max_blocks = load_for_decode(args, sizes)
vocab = resolved.config.vocab_size
tokens = args.prefill_tokens or 2048
for rep in range(2):
    for step_kv, heavy in [(False, False), (True, True), (True, False), (False, True)]:
        tk.PREFILL_STEP_KV, tk.PREFILL_HEAVY_FIRST = step_kv, heavy
        step = prefill_step(model, compiled, tokens, vocab)
        launched = time_ms(step, iters=10)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = time_ms(graph.replay, iters=10)
        line = f"step_kv={step_kv} heavy_first={heavy}: launched {launched:.2f} ms, graph {replay:.2f} ms"
        if rep == 0:
            kernels = profile_step(graph.replay, 5)
            total = sum(us for _, us in kernels.values()) / 1e3
            attn = sum(us for name, (_, us) in kernels.items() if "prefill" in name.lower()) / 1e3
            line += f", graph kernels {total:.2f} ms (prefill kernel {attn:.2f} ms)"
        print(line, flush=True)
        del graph
