"""Startup and throughput through the real gRPC servers, against transformers' `generate_batch` in the same run.

1. Starts `kiln compile-server` and `kiln exec-server` as child processes on loopback (fresh store).
2. Compiles the model (cold), then LoadModel twice: the first downloads the bundle from the compile service,
   the second (after UnloadModel) finds it in the execute service's cache; each phase's seconds are reported.
3. Sends N requests at once (prompt lengths uniform in [--min-prompt, --max-prompt], fixed seed, --output-len
   tokens each with ignore_eos, greedy) and reports output tokens/s.
4. Stops the servers and runs the same prompts through transformers' `generate_batch` on the same config.

usage: python bench/serving.py [--preset llama-3-8b] [--requests 128]
"""

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import grpc

from kiln.grpc_server import CHANNEL_OPTIONS
from kiln_cli.service_process import LocalServices
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc


async def load(stub, request) -> dict:
    phases, started = {}, time.perf_counter()
    async for event in stub.LoadModel(request):
        if event.HasField("phase") and not event.phase.progress:
            phases[event.phase.phase] = event.phase.seconds
            print(f"  {event.phase.phase:<20} {event.phase.seconds:7.2f}s  {event.phase.detail}", flush=True)
        elif event.HasField("ready"):
            sizing = event.ready
    phases["total"] = time.perf_counter() - started
    return {"phases": phases, "blocks": sizing.num_kv_blocks, "capture_sizes": list(sizing.capture_sizes)}


async def generate_all(stub, model: str, prompts: list[list[int]], output_len: int) -> dict:
    async def one(prompt):
        tokens, usage = 0, None
        async for response in stub.Generate(exec_pb2.GenerateRequest(
                model=model, prompt_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)):
            tokens += len(response.token_ids)
            if response.HasField("usage"):
                usage = response.usage
        return tokens, usage

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - started
    tokens = sum(t for t, _ in results)
    ttft = sorted(u.time_to_first_token_s for _, u in results)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_median_s": ttft[len(ttft) // 2]}


async def kiln_run(args, prompts, tmp: Path) -> dict:
    services = LocalServices(tmp, tmp / "store")
    try:
        services.start(300)
        spec = common_pb2.ModelSpec(preset=args.preset, dtype=args.dtype)
        config = common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=args.max_num_batched_tokens)
        async with grpc.aio.insecure_channel(services.compile.address, options=CHANNEL_OPTIONS) as channel:
            started = time.perf_counter()
            async for _ in compile_pb2_grpc.CompileServiceStub(channel).Compile(
                    compile_pb2.CompileRequest(model=spec, config=config)):
                pass
            cold_compile_s = time.perf_counter() - started
        request = exec_pb2.LoadModelRequest(name="bench", model=spec, config=config, max_num_seqs=args.max_num_seqs,
                                            max_model_len=args.max_prompt + args.output_len + 16)
        async with grpc.aio.insecure_channel(services.exec.address, options=CHANNEL_OPTIONS) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            print("LoadModel (bundle downloaded from the compile service):")
            first = await load(stub, request)
            await stub.UnloadModel(exec_pb2.UnloadModelRequest(name="bench"))
            print("LoadModel (bundle in the execute service's cache):")
            second = await load(stub, request)
            await generate_all(stub, "bench", prompts[:8], 8)  # warm-up
            await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(reset=True))
            throughput = await generate_all(stub, "bench", prompts, args.output_len)
            stats = await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="bench"))
            await stub.UnloadModel(exec_pb2.UnloadModelRequest(name="bench"))
        services.stop()
    finally:
        services.cleanup()
    return {"cold_compile_s": cold_compile_s, "first_load": first, "second_load": second, "throughput": throughput,
            "forward_stats": [(s.batch_size, s.count, round(s.median_ms, 2)) for s in stats.stats]}


def hf_run(args, prompts) -> dict:
    """transformers' continuous batching over the same prompts, same config, dummy weights, greedy."""
    import torch
    from transformers import GenerationConfig

    from kiln.model import build_model
    from kiln.model_spec import resolve

    resolved = resolve(common_pb2.ModelSpec(preset=args.preset, dtype=args.dtype), "cuda")
    causal_lm = build_model(resolved, "cuda").causal_lm
    causal_lm.config._attn_implementation = "sdpa"
    generation = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    with torch.no_grad():
        causal_lm.generate_batch(inputs=prompts[:4], generation_config=generation)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = causal_lm.generate_batch(inputs=prompts, generation_config=generation)
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    rng = random.Random(args.seed)
    from kiln.model_spec import PRESETS

    vocab = PRESETS[args.preset]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(kiln_run(args, prompts, Path(tmp)))
    if not args.skip_hf:
        try:
            result["hf"] = hf_run(args, prompts)
        except Exception as exc:  # noqa: BLE001 - the peer failing is a result to report, not a crash
            result["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    k, hf = result["throughput"], result.get("hf", {})
    print(f"\n{args.preset} {args.dtype}, {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
          f"{args.output_len} output tokens each, greedy, {time.strftime('%Y-%m-%d')}")
    print("| phase | first LoadModel s (download) | second LoadModel s (cached) |")
    print("|---|---|---|")
    for phase in result["second_load"]["phases"]:
        print(f"| {phase} | {result['first_load']['phases'].get(phase, 0):.2f} | "
              f"{result['second_load']['phases'][phase]:.2f} |")
    print("\n| system | output tokens | wall s | output tokens/s | vs transformers |")
    print("|---|---|---|---|---|")
    ratio = f"{k['tokens_per_s'] / hf['tokens_per_s']:.1f}x" if "tokens_per_s" in hf else "-"
    print(f"| Kiln (gRPC, CUDA graphs) | {k['output_tokens']} | {k['wall_s']:.1f} | {k['tokens_per_s']:.0f} "
          f"| {ratio} |")
    if "tokens_per_s" in hf:
        print(f"| transformers generate_batch | {hf['output_tokens']} | {hf['wall_s']:.1f} | {hf['tokens_per_s']:.0f} "
              f"| 1.0x |")
    else:
        print(f"| transformers generate_batch | failed: {hf.get('error', 'skipped')} | | | |")
    print(f"\nforward stats {result['forward_stats']}")


if __name__ == "__main__":
    main()
