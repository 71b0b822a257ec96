"""Forward time per batch size on one GPU: Kiln (compiled + CUDA graph) against the same model eager, eager + CUDA
graph, compiled without graphs, Hugging Face transformers' own forward, and the memory-bandwidth floor.

Every step decodes one new token per sequence over a context of --context tokens in the paged KV cache, and
includes the logits. The floor is (weight bytes + KV bytes read) / the copy bandwidth measured in this run.

usage: python bench/forward_latency.py --bundle STORE/KEY [--preset llama-3-8b] [--batch-sizes 1,2,4,8,16,32,64]
       [--quantization fp8 [--quantize-head]]   (a bundle compiled with --quantization fp8: bench/compile_times.py,
       kiln compile)
       [--kv-cache-dtype fp8_e4m3]   (an FP8 KV cache: the floor counts its bytes)
       [--prefill-tokens 2048]
"""

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
from exec_service.engine.kv import kv_cache
from exec_service.engine.step_inputs import StepBuffers
from kiln import programmatic_launch
from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.compilation.counters import expect_no_compile
from kiln.model.causal_lm import build_model, weights_bytes
from kiln.model.spec import ResolvedModel, resolve
from kiln.store.bundle import KEY_FACTORS, load_compiled
from kiln.store.signing import TrustedKeys, local_keys_dir
from protos import common_pb2

BLOCK_SIZE = 16


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.randn(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def time_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def decode_metadata(bs: int, context: int, max_blocks: int) -> AttentionMetadata:
    """bs sequences of `context` cached tokens, each decoding its next token; blocks laid out per sequence."""
    tables = torch.arange(bs * max_blocks, dtype=torch.int32, device="cuda").view(bs, max_blocks)
    slot = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    return AttentionMetadata(
        slot_mapping=slot, query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((bs,), context + 1, dtype=torch.int32, device="cuda"), block_tables=tables,
        max_query_len=1, num_seqs=bs)


def fill_step_buffers(buffers: StepBuffers, ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> None:
    """Put a decode step where the CUDA graphs read it, as the model runner's step buffers hold it."""
    bs = ids.shape[0]
    buffers.input_ids[:bs].copy_(ids)
    buffers.positions[:bs].copy_(positions)
    buffers.slot_mapping[:bs].copy_(meta.slot_mapping)
    buffers.query_start_loc[:bs + 1].copy_(meta.query_start_loc)
    buffers.seq_lens[:bs].copy_(meta.seq_lens)
    buffers.block_tables[:bs, :meta.block_tables.shape[1]].copy_(meta.block_tables)


@dataclass
class DecodeSetup:
    resolved: ResolvedModel
    model: torch.nn.Module
    spec: kv_cache.KVCacheSpec
    caches: list[torch.Tensor]
    scales: list[torch.Tensor] | None  # an FP8 cache's per-layer scales (kv_cache.allocate_scales)
    compiled: torch.nn.Module
    max_blocks: int  # blocks a sequence's table holds


def load_for_decode(args: argparse.Namespace, sizes: list[int]) -> DecodeSetup:
    """The preset's model (dummy weights), a paged KV cache of random values for ``args.context`` tokens of the
    largest batch (FP8 with --kv-cache-dtype fp8_e4m3, scales 1.0), and the bundle's compiled code, loaded and first
    called as the execute service loads and warms it up (signature checked, no compile, the largest step first)."""
    torch.set_grad_enabled(False)
    resolved = resolve(common_pb2.ModelSpec(preset=args.preset, dtype="bfloat16"), "cuda")
    model = build_model(resolved, "cuda", quantization=args.quantization, quantize_head=args.quantize_head)
    spec = kv_cache.KVCacheSpec.from_config(resolved.config, BLOCK_SIZE,
                                            kv_cache.cache_dtype(args.kv_cache_dtype, resolved.dtype))
    max_blocks = -(-(args.context + 1) // BLOCK_SIZE)
    caches = kv_cache.allocate(spec, max(sizes) * max_blocks, "cuda")
    for cache in caches:  # (normal_ has no FP8 kernel)
        cache.copy_(torch.randn(cache.shape, dtype=resolved.dtype, device="cuda"))
    with expect_no_compile("loading the bundle"):
        compiled = load_compiled(args.bundle, args.bundle.name, TrustedKeys.load(
            args.trusted_keys or local_keys_dir(args.bundle.parent)))
    # The first call at the bundle's largest step, as the execute service's warm-up makes it: Inductor's kernels
    # pick their config at their first call. No forward context: the op's own causal attention, no cache.
    tokens = json.loads((args.bundle / KEY_FACTORS).read_text())["compile_config"]["max_compiled_tokens"]
    with expect_no_compile("warming up"):
        compiled(model, torch.zeros(tokens, dtype=torch.int64, device="cuda"), torch.arange(tokens, device="cuda"))
    return DecodeSetup(resolved, model, spec, caches, kv_cache.allocate_scales(spec, 1.0, "cuda"), compiled,
                       max_blocks)


def prefill_step(model, compiled, tokens: int, vocab: int, spec: kv_cache.KVCacheSpec):
    """One sequence's first ``tokens`` tokens in one compiled step over an empty paged cache of its own (laid out as
    ``spec``, the decode's: its dtype is the model's or the --kv-cache-dtype, never the head's), with the last token's
    logits: a function that runs it."""
    blocks = -(-tokens // BLOCK_SIZE)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device="cuda"),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device="cuda"),
        block_tables=torch.arange(blocks, dtype=torch.int32, device="cuda")[None], max_query_len=tokens, num_seqs=1)
    ctx = ForwardContext(kv_cache.allocate(spec, blocks, "cuda"), meta, kv_cache.allocate_scales(spec, 1.0, "cuda"))
    ids = torch.randint(0, vocab, (tokens,), device="cuda")
    positions = torch.arange(tokens, device="cuda")

    def step():
        with forward_context(ctx):
            model.logits(compiled(model, ids, positions)[-1:])

    return step


def prefill_ms(model, compiled, tokens: int, vocab: int, spec: kv_cache.KVCacheSpec) -> tuple[float, float]:
    """The step launched from Python, and captured in a CUDA graph and replayed (as Kiln replays a mixed step of up
    to its largest capture size): ms each."""
    step = prefill_step(model, compiled, tokens, vocab, spec)
    launched = time_ms(step, iters=10)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return launched, time_ms(graph.replay, iters=10)


def decode_bench_args(batch_sizes: str) -> tuple[argparse.Namespace, list[int]]:
    """The command line of a bench that decodes a bundle's model at several batch sizes: its args and the sizes."""
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--trusted-keys", type=Path, help="public key(s) the bundle must be signed by (default: the key "
                   "pair kept beside its store, as kiln demo and kiln bench keep it)")
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--batch-sizes", default=batch_sizes)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time one compiled prefill step of this many new tokens (at most the compiled range)")
    p.add_argument("--quantization", default="", choices=["", "fp8"],
                   help="fp8: the decoder's linears in FP8 (the bundle must be compiled with the same)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantization fp8: the head in FP8 too")
    p.add_argument("--kv-cache-dtype", default="", choices=["", "fp8_e4m3"], help="fp8_e4m3: an FP8 KV cache")
    p.add_argument("--no-kernel-pdl", action="store_true",
                   help="Kiln's FP8 GEMM without programmatic dependent launch (what it gives, by difference)")
    p.add_argument("--weight-prefetch-kb", type=int, default=programmatic_launch.PREFETCH_BYTES // 1024,
                   help="weight KB each program of Kiln's FP8 GEMM asks the L2 for while the quantize before it runs "
                        "(0: none; kiln.programmatic_launch)")
    p.add_argument("--small-kernel-pdl", action="store_true",
                   help="Kiln's norm and attention-output quantize kernels (8 warps) launched with PDL themselves")
    p.add_argument("--kiln-only", action="store_true",
                   help="time Kiln's step alone (A/B runs of one setting; the other columns print as -)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    programmatic_launch.ENABLED = not args.no_kernel_pdl
    programmatic_launch.PREFETCH_BYTES = args.weight_prefetch_kb * 1024
    programmatic_launch.SMALL_KERNEL_PDL = args.small_kernel_pdl
    return args, [int(s) for s in args.batch_sizes.split(",")]


def main() -> None:
    args, sizes = decode_bench_args("1,2,4,8,16,32,64")
    setup = load_for_decode(args, sizes)
    resolved, model, spec, caches, compiled, max_blocks = (setup.resolved, setup.model, setup.spec, setup.caches,
                                                           setup.compiled, setup.max_blocks)
    bandwidth = copy_bandwidth()
    w_bytes = weights_bytes(model)
    config = resolved.config
    vocab = config.vocab_size

    def compiled_forward(ids, pos):
        return compiled(model, ids, pos)

    buffers = StepBuffers(max(sizes), max(sizes), max_blocks, BLOCK_SIZE, vocab, "cuda", spec.num_kv_heads)
    graphs = {name: CUDAGraphs(fn, tuple(sizes), buffers, buffers.graph_metadata, config.hidden_size, resolved.dtype,
                               torch.device("cuda"))
              for name, fn in (("kiln", compiled_forward), ("eager+graph", model))}
    for name, g in graphs.items():
        with expect_no_compile(f"capturing {name}"):
            g.capture(caches, kv_scales=setup.scales)

    rows = []
    for bs in sizes:
        meta = decode_metadata(bs, args.context, max_blocks)
        ids = torch.randint(0, vocab, (bs,), device="cuda")
        pos = torch.full((bs,), args.context, dtype=torch.int64, device="cuda")
        ctx = ForwardContext(caches, meta, setup.scales)
        fill_step_buffers(buffers, ids, pos, meta)

        def eager(ctx=ctx, ids=ids, pos=pos):
            with forward_context(ctx):
                model.logits(model(ids, pos))

        def compiled_step(ctx=ctx, ids=ids, pos=pos):
            with forward_context(ctx):
                model.logits(compiled(model, ids, pos))

        def graphed(name, bs=bs):
            return lambda: model.logits(graphs[name].replay(graphs[name].padded_size(bs))[:bs])

        kv_read = bs * (args.context + 1) * spec.block_bytes // BLOCK_SIZE
        floor_ms = (w_bytes + kv_read) / bandwidth * 1e3
        row = {"batch_size": bs, "floor_ms": floor_ms, "kiln_ms": time_ms(graphed("kiln"))}
        if not args.kiln_only:
            row |= {"eager_ms": time_ms(eager), "eager_graph_ms": time_ms(graphed("eager+graph")),
                    "compiled_ms": time_ms(compiled_step), "hf_ms": hf_forward_ms(model, bs, args.context, vocab)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s, weights {w_bytes / 1e9:.2f} GB, context {args.context}, "
          f"{args.preset} bf16{' fp8 linears' if args.quantization else ''}"
          f"{' and head' if args.quantize_head else ''}{', FP8 KV' if args.kv_cache_dtype else ''}, "
          f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
    print("| batch | floor ms | Kiln (compiled+graph) ms | Kiln/floor | eager ms | eager+graph ms | compiled ms "
          "| HF transformers ms | HF/Kiln |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        others = " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in ("eager_ms", "eager_graph_ms", "compiled_ms",
                                                                         "hf_ms"))
        hf_ratio = f"{r['hf_ms'] / r['kiln_ms']:.1f}x" if "hf_ms" in r else "-"
        print(f"| {r['batch_size']} | {r['floor_ms']:.2f} | {r['kiln_ms']:.2f} | {r['kiln_ms'] / r['floor_ms']:.2f}x | "
              f"{others} | {hf_ratio} |")
    prefill = prefill_ms(model, compiled, args.prefill_tokens, vocab, spec) if args.prefill_tokens else None
    if prefill is not None:
        print(f"\none prefill step of {args.prefill_tokens} new tokens (compiled, last logits): {prefill[0]:.2f} ms "
              f"launched from Python, {prefill[1]:.2f} ms replayed from a CUDA graph")
    if args.json_out:
        args.json_out.write_text(json.dumps({"bandwidth": bandwidth, "rows": rows, "prefill_ms": prefill}, indent=1))
        plot(rows, args.json_out.with_suffix(".png"), args.preset)


def hf_forward_ms(model, bs: int, context: int, vocab: int) -> float:
    """transformers' own decode step (sdpa attention, DynamicCache) over the same context."""
    causal_lm = model.causal_lm
    previous = causal_lm.config._attn_implementation
    causal_lm.config._attn_implementation = "sdpa"
    try:
        cache = DynamicCache(config=causal_lm.config)
        prompt = torch.randint(0, vocab, (bs, context), device="cuda")
        causal_lm(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step = torch.randint(0, vocab, (bs, 1), device="cuda")
        cache.crop(context)

        def forward():
            causal_lm(input_ids=step, past_key_values=cache, use_cache=True)
            cache.crop(context)

        return time_ms(forward, iters=10)
    finally:
        causal_lm.config._attn_implementation = previous
        torch.cuda.empty_cache()


def plot(rows, path: Path, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("kiln_ms", "Kiln (compiled + CUDA graph)"), ("compiled_ms", "compiled, no graph"),
                       ("eager_graph_ms", "eager + CUDA graph"), ("eager_ms", "eager"),
                       ("hf_ms", "HF transformers"), ("floor_ms", "memory-bandwidth floor")):
        if key in rows[0]:  # (--kiln-only: Kiln and the floor)
            ax.plot(sizes, [r[key] for r in rows], marker="o", label=label,
                    linestyle="--" if key == "floor_ms" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences, 1 new token each)")
    ax.set_ylabel("forward time (ms)")
    ax.set_title(f"{preset} bf16 decode forward, context 1024, H200")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
