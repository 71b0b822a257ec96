"""Prefix caching on against off, in one run, through the real gRPC servers (docs/prefix-caching.md, issue 25).

Three workloads, each on the same model loaded once with caching off and once with it on (one model at a time, so
both get the same KV cache), greedy with ignore_eos, every request of a workload sent at once:
(a) shared system prompt: --requests requests of one --system-len-token system prompt and a --unique-len-token
    question of their own, --output-len tokens each: TTFT p50 and output throughput (bench/serving.py's figures, as
    vLLM's benchmark_serving measures them). The cache holds nothing of that system prompt when the run starts.
(b) multi-turn chat: --chats chats of --turns turns, each turn sending the whole conversation so far (its earlier
    turns' tokens and the model's answers) plus --chat-new-tokens new tokens, --chat-output-len tokens back: the
    prompt tokens the service computed over those it was sent (sent - Usage.cached_tokens).
(c) no shared prefixes: --requests prompts of random tokens, lengths uniform in [--min-prompt, --max-prompt]:
    output throughput, on over off (what the lookups and hashing cost).

Starts `kiln compile-server` and `kiln exec-server` on loopback (fresh store) unless --exec-server names a running
one (its compile service then compiles or finds the bundle of --preset and the compile flags here).

usage: python bench/prefix_caching.py [--preset llama-3-8b] [--json-out F]
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from serving import GrpcBackend, latency_metrics, load, send_all

from kiln.model.spec import PRESETS
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln_cli.service_process import LocalServices
from protos import common_pb2, exec_pb2, exec_pb2_grpc

MODES = (("off", False), ("on", True))


def random_tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


async def shared_system_prompt(stub, model: str, args, vocab: int) -> dict:
    """(a): TTFT and throughput of requests that share one system prompt."""
    rng = random.Random(args.seed)
    system = random_tokens(rng, vocab, args.system_len)
    prompts = [system + random_tokens(rng, vocab, args.unique_len) for _ in range(args.requests)]
    timings, duration = await send_all(GrpcBackend(stub, model), prompts, args.output_len, [0.0] * len(prompts))
    metrics = latency_metrics(timings, duration)
    return {"median_ttft_ms": metrics["median_ttft_ms"], "p99_ttft_ms": metrics["p99_ttft_ms"],
            "output_throughput": metrics["output_throughput"], "duration_s": duration,
            **computed_fraction(metrics["input_tokens"], sum(t.cached_tokens for t in timings))}


async def multi_turn_chat(stub, model: str, args, vocab: int) -> dict:
    """(b): every chat at once, each turn after the one before it, resending the conversation."""
    rng = random.Random(args.seed + 1)
    chats = [[random_tokens(rng, vocab, args.chat_new_tokens) for _ in range(args.turns)] for _ in range(args.chats)]
    sent = cached = 0

    async def chat(turns: list[list[int]]) -> None:
        nonlocal sent, cached
        conversation: list[int] = []
        for new in turns:
            conversation += new
            request = exec_pb2.GenerateRequest(model=model, prompt_ids=conversation, max_tokens=args.chat_output_len,
                                               temperature=0.0, ignore_eos=True)
            answer = []
            async for response in stub.Generate(request):
                answer += response.token_ids
                if response.HasField("usage"):
                    cached += response.usage.cached_tokens
            sent += len(conversation)
            conversation += answer

    started = time.perf_counter()
    await asyncio.gather(*(chat(turns) for turns in chats))
    return {"duration_s": time.perf_counter() - started, **computed_fraction(sent, cached)}


async def no_shared_prefixes(stub, model: str, args, vocab: int) -> dict:
    """(c): throughput where nothing is shared, so every lookup misses. A cost of a few percent is within one run's
    noise, so it runs --repeats times, each with prompts of its own (a repeat of the same prompts would hit): the
    median throughput and TTFT p50 of the runs, every run's throughput, the prompt tokens of all of them."""
    throughputs, ttfts, duration, sent, cached = [], [], 0.0, 0, 0
    for repeat in range(args.repeats):
        rng = random.Random(args.seed + 2 + 1000 * repeat)
        prompts = [random_tokens(rng, vocab, rng.randint(args.min_prompt, args.max_prompt))
                   for _ in range(args.requests)]
        timings, seconds = await send_all(GrpcBackend(stub, model), prompts, args.output_len, [0.0] * len(prompts))
        metrics = latency_metrics(timings, seconds)
        throughputs.append(metrics["output_throughput"])
        ttfts.append(metrics["median_ttft_ms"])
        duration += seconds
        sent += metrics["input_tokens"]
        cached += sum(t.cached_tokens for t in timings)
    return {"output_throughput": statistics.median(throughputs), "runs_output_throughput": throughputs,
            "median_ttft_ms": statistics.median(ttfts), "duration_s": duration, **computed_fraction(sent, cached)}


def computed_fraction(sent: int, cached: int) -> dict:
    return {"prompt_tokens_sent": sent, "prompt_tokens_cached": cached,
            "computed_fraction": (sent - cached) / sent if sent else 0.0}


WORKLOADS = (("shared_system_prompt", shared_system_prompt), ("multi_turn_chat", multi_turn_chat),
             ("no_shared_prefixes", no_shared_prefixes))


def load_request(args, name: str, caching: bool) -> exec_pb2.LoadModelRequest:
    longest = max(args.system_len + args.unique_len + args.output_len,
                  args.turns * (args.chat_new_tokens + args.chat_output_len), args.max_prompt + args.output_len)
    return exec_pb2.LoadModelRequest(
        name=name, model=common_pb2.ModelSpec(preset=args.preset, dtype=args.dtype),
        config=common_pb2.CompileConfig(device=args.device, max_compiled_tokens=args.max_num_batched_tokens,
                                        compile_sizes=args.compile_sizes),
        max_num_seqs=args.max_num_seqs, max_model_len=longest + 16, enable_prefix_caching=caching)


async def run(address: str, args) -> dict:
    vocab = PRESETS[args.preset]["vocab_size"]
    results: dict = {}
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = exec_pb2_grpc.ExecServiceStub(channel)
        for mode, caching in MODES:
            name = f"prefix-bench-{mode}"
            print(f"LoadModel {name}:", flush=True)
            await load(stub, load_request(args, name, caching))
            try:
                warm_up = [random_tokens(random.Random(args.seed + 3 + i), vocab, 16) for i in range(4)]
                await send_all(GrpcBackend(stub, name), warm_up, 4, [0.0] * len(warm_up))
                for workload, fn in WORKLOADS:
                    results.setdefault(workload, {})[mode] = result = await fn(stub, name, args, vocab)
                    print(f"  {workload} (caching {mode}): {json.dumps(result)}", flush=True)
                info = next(m for m in (await stub.ListModels(exec_pb2.ListModelsRequest())).models if m.name == name)
                results.setdefault("prefix_cache", {})[mode] = {
                    "queried_tokens": info.prefix_cache_queried_tokens, "hit_tokens": info.prefix_cache_hit_tokens,
                    "cached_blocks": info.prefix_cache_blocks, "evicted_blocks": info.prefix_cache_evicted_blocks,
                    "num_kv_blocks": info.sizing.num_kv_blocks}
            finally:
                await stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
    return results


async def with_local_services(args, tmp: Path) -> dict:
    services = LocalServices(tmp, tmp / "store")
    try:
        services.start(300)
        results = await run(services.exec.address, args)
        services.stop()
    except BaseException:
        print(services.log_tails())
        raise
    finally:
        services.cleanup()
    return results


def print_tables(results: dict, args) -> None:
    a, b, c = (results[w] for w, _ in WORKLOADS)
    print(f"\n{args.preset} {args.dtype}, {time.strftime('%Y-%m-%d')}; every request of a workload sent at once, "
          f"greedy, ignore_eos")
    print(f"\n(a) {args.requests} requests, a {args.system_len}-token system prompt + {args.unique_len} tokens each, "
          f"{args.output_len} output tokens")
    print("| prefix caching | TTFT p50 ms | TTFT p99 ms | output tok/s | prompt tokens computed |")
    print("|---|---|---|---|---|")
    for mode, _ in MODES:
        r = a[mode]
        print(f"| {mode} | {r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['output_throughput']:.0f} | "
              f"{100 * r['computed_fraction']:.1f}% |")
    print(f"on/off: TTFT p50 {a['on']['median_ttft_ms'] / a['off']['median_ttft_ms']:.3f}x, output throughput "
          f"{a['on']['output_throughput'] / a['off']['output_throughput']:.2f}x")
    print(f"\n(b) {args.chats} chats x {args.turns} turns, each resending the conversation + {args.chat_new_tokens} "
          f"new tokens, {args.chat_output_len} output tokens a turn")
    print("| prefix caching | prompt tokens sent | computed | computed / sent | wall s |")
    print("|---|---|---|---|---|")
    for mode, _ in MODES:
        r = b[mode]
        print(f"| {mode} | {r['prompt_tokens_sent']} | {r['prompt_tokens_sent'] - r['prompt_tokens_cached']} | "
              f"{100 * r['computed_fraction']:.1f}% | {r['duration_s']:.1f} |")
    print(f"\n(c) {args.requests} requests of random tokens, prompts {args.min_prompt}-{args.max_prompt}, "
          f"{args.output_len} output tokens, {args.repeats} runs each (medians)")
    print("| prefix caching | output tok/s | every run's tok/s | TTFT p50 ms | prompt tokens cached |")
    print("|---|---|---|---|---|")
    for mode, _ in MODES:
        r = c[mode]
        runs = ", ".join(f"{t:.0f}" for t in r["runs_output_throughput"])
        print(f"| {mode} | {r['output_throughput']:.0f} | {runs} | {r['median_ttft_ms']:.1f} | "
              f"{r['prompt_tokens_cached']} |")
    print(f"on/off: output throughput {c['on']['output_throughput'] / c['off']['output_throughput']:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--compile-sizes", type=lambda t: [int(s) for s in t.split(",") if s], default=[],
                   help="comma-separated token counts compiled statically (default: the compile service's)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--unique-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--chat-new-tokens", type=int, default=64)
    p.add_argument("--chat-output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs of workload (c) per mode, each with new prompts")
    p.add_argument("--exec-server", default="", help="a running execute service (default: start both locally)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    if args.exec_server:
        results = asyncio.run(run(args.exec_server, args))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            results = asyncio.run(with_local_services(args, Path(tmp)))
    print_tables(results, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
