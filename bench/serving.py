"""Throughput and latency under load through the real gRPC servers, against transformers' `generate_batch`.

1. Starts `kiln compile-server` and `kiln exec-server` as child processes on loopback (fresh store), compiles the
   model (cold), then LoadModel twice: the first downloads the bundle, the second (after UnloadModel) finds it in the
   execute service's cache; each phase's seconds are reported. (`--exec-server` and `--model` use a running
   service and a model loaded there instead.)
2. For each `--request-rate` R: N requests (prompt lengths uniform in [--min-prompt, --max-prompt], fixed seed,
   --output-len tokens each with ignore_eos, greedy) arrive as a Poisson process of R requests/s (exponential gaps
   from a fixed seed; `inf` sends them all at once), and the run reports what vLLM's `benchmark_serving` reports,
   figure for figure: request and token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median, P99),
   measured at the client as vLLM measures them. Then Kiln's own: the fraction of the wall time the GPU ran
   forwards (the sum of the forward times the engine measured with CUDA events, over the run's duration), the
   fraction it sat idle waiting for the host while the engine had work (GetForwardStats' host_wait_ms: what the
   host, not a lack of requests, cost), and the execute service's CPU time per output token: its event-loop
   thread (gRPC, protobuf, asyncio: the cost of streaming each token) and its other threads (the engine thread
   above all). Linux, local services only.
3. Runs the same prompts through transformers' `generate_batch` (the saturated figure's reference).
4. With --json-out F: the results as JSON, the per-rate table as F's stem + `_rates.csv`, and TTFT and ITL against
   the rate as `_rates.png` when matplotlib is importable (else it says so; the CSV has the same figures).

`--backend openai` sends the same requests through the OpenAI-compatible gateway instead (streamed
`/v1/completions`, as vLLM's benchmark_serving sends them to vLLM): `kiln api-server` started as a child process in
front of the execute service, or a running one at `--api-url`. The result block is the same, plus the gateway's CPU
time per output token when it runs here. `--backend openai-exec` sends them to the execute service's own OpenAI
endpoint (`kiln exec-server --openai-port`: the same app in the service's process, no gateway hop). `--backend
grpc,openai,openai-exec` runs each in turn against the same loaded model, at every rate: what each path costs, side
by side.

usage: python bench/serving.py [--preset llama-3-8b] [--requests 128] [--request-rate 2,8,32,inf] [--json-out F]
                               [--backend grpc|openai|openai-exec|grpc,openai,...] [--tensor-parallel-size 2]
                               [--stream-interval 8] [--skip-hf]
"""

import argparse
import asyncio
import csv
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from kiln.client.channels import connect_aio
from kiln.client.compile import compile_model_async
from kiln.client.load import load_async, phase_line
from kiln.client.requests import compile_config, model_spec
from kiln_cli.service_process import LocalServices, free_port, kiln_command
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

SECTION_WIDTH = 50  # vLLM's result block: 50 columns, labels left-aligned in 40


@dataclass
class RequestTiming:
    """One request as the client saw it: perf_counter seconds."""

    prompt_tokens: int
    sent: float
    arrivals: list[float] = field(default_factory=list)  # each message that carried tokens
    output_tokens: int = 0
    done: float = 0.0
    cached_tokens: int = 0  # prompt tokens the execute service found in its prefix cache (the last message's usage)
    error: str = ""  # a refused or failed request: its status (RESOURCE_EXHAUSTED, HTTP 429, ...)


async def load(stub, request) -> dict:
    phases, started = {}, time.perf_counter()

    def phase(p: exec_pb2.StartupPhase) -> None:
        if not p.progress:
            phases[p.phase] = p.seconds
            print(phase_line(p), flush=True)

    sizing = await load_async(stub, request, phase)
    phases["total"] = time.perf_counter() - started
    return {"phases": phases, "blocks": sizing.num_kv_blocks, "capture_sizes": list(sizing.capture_sizes)}


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of ``rate`` per second."""
    if math.isinf(rate):
        return [0.0] * count
    rng, now, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


class GrpcBackend:
    """Generate on the execute service itself."""

    name = "grpc"

    def __init__(self, stub, model: str):
        self.stub, self.model = stub, model

    async def prepare(self, count: int) -> None:
        pass

    async def tokens(self, prompt: list[int], output_len: int) -> AsyncIterator[tuple[int, int | None]]:
        """Each message as it arrives: its tokens, and the prompt tokens found in the prefix cache (on the last)."""
        async for response in self.stub.Generate(exec_pb2.GenerateRequest(
                model=self.model, prompt_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)):
            yield len(response.token_ids), response.usage.cached_tokens if response.HasField("usage") else None

    @staticmethod
    def failure(exc: Exception) -> str | None:
        """The status a failed request counts under; None for an error that is the bench's own."""
        return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else None


class OpenAIBackend:
    """Streamed /v1/completions through the gateway; ``return_token_ids`` counts the tokens of each chunk (the
    dummy-weight presets have no tokenizer, so there is no text to count)."""

    def __init__(self, url: str, model: str, name: str = "openai"):
        from openai_stream import HttpError, SseClient

        self.client, self.model, self.http_error, self.name = SseClient(url), model, HttpError, name

    async def prepare(self, count: int) -> None:
        await self.client.open(count)

    async def tokens(self, prompt: list[int], output_len: int) -> AsyncIterator[tuple[int, int | None]]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        async for chunk in self.client.events("/v1/completions", body):
            for choice in chunk["choices"]:
                yield len(choice["token_ids"]), None
            if chunk.get("usage"):
                yield 0, chunk["usage"]["prompt_tokens_details"]["cached_tokens"]

    def failure(self, exc: Exception) -> str | None:
        return f"HTTP {exc.status}" if isinstance(exc, self.http_error) else None


async def send_all(backend, prompts: list[list[int]], output_len: int, offsets: list[float]
                   ) -> tuple[list[RequestTiming], float]:
    """Every request at its offset; returns their timings and the wall time from the first send to the last token."""

    async def one(prompt: list[int], offset: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        timing = RequestTiming(len(prompt), time.perf_counter())
        try:
            async for count, cached in backend.tokens(prompt, output_len):
                if count:
                    timing.arrivals.append(time.perf_counter())
                    timing.output_tokens += count
                if cached is not None:
                    timing.cached_tokens = cached
        except Exception as exc:  # a refused request counts as failed, as in vLLM's benchmark_serving
            timing.error = backend.failure(exc)
            if not timing.error:
                raise
        timing.done = time.perf_counter()
        return timing

    await backend.prepare(len(prompts))

    start = time.perf_counter()
    timings = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True)))
    return timings, max(t.done for t in timings) - start


def latency_metrics(timings: list[RequestTiming], duration_s: float) -> dict:
    """vLLM benchmark_serving's figures: TTFT from send to the first token, TPOT over the tokens after it, ITL between
    successive messages, E2EL from send to the last token; milliseconds. Failed requests are counted by status and
    left out of every other figure."""
    failed = Counter(t.error for t in timings if t.error)
    timings = [t for t in timings if not t.error]
    ttft = [(t.arrivals[0] - t.sent) * 1e3 for t in timings]
    tpot = [(t.done - t.arrivals[0]) * 1e3 / (t.output_tokens - 1) for t in timings if t.output_tokens > 1]
    itl = [(b - a) * 1e3 for t in timings for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
    e2el = [(t.done - t.sent) * 1e3 for t in timings]
    output = sum(t.output_tokens for t in timings)
    metrics = {
        "completed": len(timings), "failed": sum(failed.values()), "failures": dict(failed),
        "duration_s": duration_s, "input_tokens": sum(t.prompt_tokens for t in timings),
        "output_tokens": output, "request_throughput": len(timings) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (output + sum(t.prompt_tokens for t in timings)) / duration_s,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        values = values or [0.0]
        metrics |= {f"mean_{name}_ms": statistics.mean(values), f"median_{name}_ms": float(np.percentile(values, 50)),
                    f"p99_{name}_ms": float(np.percentile(values, 99))}
    return metrics


def _cpu_s(stat: Path) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    text = stat.read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of proc(5)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a whole process, threads that have ended included (a sum over its live threads is not)."""
    return _cpu_s(Path(f"/proc/{pid}/stat"))


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's main thread (the execute service's event loop) and of all its other threads."""
    event_loop = _cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))
    return {"event_loop": event_loop, "other_threads": process_cpu_s(pid) - event_loop}


async def run_rate(stub, backend, model: str, prompts: list[list[int]], args, rate: float, exec_pid: int | None,
                   gateway_pid: int | None = None) -> dict:
    """One rate through ``backend`` (a GrpcBackend or an OpenAIBackend)."""
    await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=model, reset=True))
    cpu_before = thread_cpu_s(exec_pid) if exec_pid else None
    gateway_before = process_cpu_s(gateway_pid) if gateway_pid else None
    timings, duration = await send_all(backend, prompts, args.output_len,
                                       arrival_offsets(len(prompts), rate, args.seed))
    stats = (await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=model))).stats
    result = {"request_rate": rate, "backend": backend.name, **latency_metrics(timings, duration)}
    result["gpu_busy"] = sum(s.total_ms for s in stats) / 1e3 / duration
    result["host_wait"] = sum(s.host_wait_ms for s in stats) / 1e3 / duration  # the device idle, waiting for the host
    result["forward_stats"] = [(s.batch_size, s.phase, s.path, s.count, round(s.median_ms, 2), round(s.p99_ms, 2))
                               for s in stats]
    busiest = max(stats, key=lambda s: s.count, default=None)
    result["typical_step"] = (busiest.batch_size, busiest.median_ms) if busiest else None
    tokens = max(1, result["output_tokens"])  # CPU per token: none when every request failed
    if cpu_before is not None:
        cpu_after = thread_cpu_s(exec_pid)
        for key in cpu_before:
            result[f"{key}_cpu_ms_per_token"] = (cpu_after[key] - cpu_before[key]) * 1e3 / tokens
    if gateway_before is not None:
        gateway_s = process_cpu_s(gateway_pid) - gateway_before
        result["gateway_cpu_ms_per_token"] = gateway_s * 1e3 / tokens
    print_result(result)
    print_step_series(stats)
    return result


def print_step_series(stats) -> None:
    """Each (batch size, phase, path) series of the run with 20 steps or more: its p99 against its p50."""
    print("| batch | phase | path | steps | p50 ms | p99 ms | p99/p50 |")
    print("|---|---|---|---|---|---|---|")
    for s in sorted(stats, key=lambda s: -s.count):
        if s.count >= 20:
            print(f"| {s.batch_size} | {s.phase} | {s.path} | {s.count} | {s.median_ms:.2f} | {s.p99_ms:.2f} | "
                  f"{s.p99_ms / s.median_ms:.2f} |")


def print_result(r: dict) -> None:
    """The block vLLM's benchmark_serving prints (percentile metrics ttft,tpot,itl,e2el), then Kiln's own lines."""
    def line(label: str, value, fmt: str = ".2f") -> None:
        print(f"{label:<40} {value:<10{fmt}}")

    def section(title: str, fill: str = "-") -> None:
        print(f"{title:{fill}^{SECTION_WIDTH}}")

    print(f"Traffic request rate: {r['request_rate']}")
    section(" Serving Benchmark Result ", "=")
    line("Successful requests:", r["completed"], "")
    if r["failed"]:
        line("Failed requests:", f"{r['failed']} ({', '.join(f'{k} {v}' for k, v in sorted(r['failures'].items()))})",
             "")
    line("Benchmark duration (s):", r["duration_s"])
    line("Total input tokens:", r["input_tokens"], "")
    line("Total generated tokens:", r["output_tokens"], "")
    line("Request throughput (req/s):", r["request_throughput"])
    line("Output token throughput (tok/s):", r["output_throughput"])
    line("Total Token throughput (tok/s):", r["total_token_throughput"])
    for key, name, title in (("ttft", "TTFT", "Time to First Token"),
                             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                             ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):
        section(title)
        line(f"Mean {name} (ms):", r[f"mean_{key}_ms"])
        line(f"Median {name} (ms):", r[f"median_{key}_ms"])
        line(f"P99 {name} (ms):", r[f"p99_{key}_ms"])
    section("Kiln execute service")
    line("Backend:", r["backend"], "")
    line("GPU busy (forward time / wall) (%):", 100 * r["gpu_busy"], ".1f")
    line("GPU waiting for the host, work queued (%):", 100 * r["host_wait"], ".1f")
    if r["typical_step"]:
        batch, ms = r["typical_step"]
        line(f"Median step at batch {batch} (ms):", ms)
    if "event_loop_cpu_ms_per_token" in r:
        line("Event-loop CPU per output token (ms):", r["event_loop_cpu_ms_per_token"], ".4f")
        line("Other threads' CPU per output token (ms):", r["other_threads_cpu_ms_per_token"], ".4f")
    if "gateway_cpu_ms_per_token" in r:
        line("API gateway CPU per output token (ms):", r["gateway_cpu_ms_per_token"], ".4f")
    section("", "=")


HEALTH_TIMEOUT_S = 60.0


@contextmanager
def gateway(args, exec_address: str, logdir: Path) -> Iterator[tuple[str | None, int | None]]:
    """With openai among --backend: (the gateway's URL, its pid when it runs here), else (None, None)."""
    if "openai" not in args.backend:
        yield None, None
        return
    if args.api_url:
        yield args.api_url, None
        return
    port = free_port()
    with open(logdir / "api-server.log", "ab") as log:
        child = subprocess.Popen(kiln_command("api-server", "--port", str(port), "--exec-server", exec_address),
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kiln api-server did not become healthy; see {logdir / 'api-server.log'}"
                                       ) from None
                time.sleep(0.2)
        yield url, child.pid
    finally:
        child.terminate()
        child.wait(timeout=60)


async def sweep(address: str, model: str, prompts: list[list[int]], args, exec_pid: int | None,
                api_url: str | None = None, gateway_pid: int | None = None,
                exec_api_url: str | None = None) -> list[dict]:
    """Every --request-rate through every --backend in turn, against the same loaded model (side by side)."""
    results = []
    async with connect_aio(address) as channel:
        stub = exec_pb2_grpc.ExecServiceStub(channel)
        for name in args.backend:
            backend = (OpenAIBackend(api_url, model) if name == "openai" else
                       OpenAIBackend(exec_api_url, model, name) if name == "openai-exec" else GrpcBackend(stub, model))
            await send_all(backend, prompts[:8], 8, [0.0] * min(8, len(prompts)))  # warm-up
            results += [await run_rate(stub, backend, model, prompts, args, rate, exec_pid,
                                       gateway_pid if name == "openai" else None) for rate in args.request_rate]
    return results


async def kiln_run(args, prompts, tmp: Path) -> dict:
    exec_api_port = free_port() if "openai-exec" in args.backend else None
    services = LocalServices(tmp, tmp / "store", openai_port=exec_api_port)
    try:
        services.start(300)
        spec = model_spec(args.preset, args.dtype)
        config = compile_config(args.device, max_compiled_tokens=args.max_num_batched_tokens,
                                quantization=args.quantization)
        if args.tensor_parallel_size > 1:  # the bundle is compiled for the ranks (a key factor), once, here
            config.tensor_parallel_size = args.tensor_parallel_size
        async with connect_aio(services.compile.address) as channel:
            started = time.perf_counter()
            await compile_model_async(compile_pb2_grpc.CompileServiceStub(channel),
                                      compile_pb2.CompileRequest(model=spec, config=config))
            cold_compile_s = time.perf_counter() - started
        request = exec_pb2.LoadModelRequest(name="bench", model=spec, config=config, max_num_seqs=args.max_num_seqs,
                                            max_num_waiting=args.max_num_waiting,
                                            stream_interval=args.stream_interval,
                                            max_model_len=args.max_prompt + args.output_len + 16,
                                            piecewise_capture_sizes=args.piecewise_capture_sizes,
                                            kv_cache_dtype=args.kv_cache_dtype,
                                            quantize_head=args.quantize_head,
                                            tensor_parallel_size=args.tensor_parallel_size,
                                            enable_prefix_caching=prefix_caching(args))
        async with connect_aio(services.exec.address) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            print("LoadModel (bundle downloaded from the compile service):")
            first = await load(stub, request)
            await stub.UnloadModel(exec_pb2.UnloadModelRequest(name="bench"))
            print("LoadModel (bundle in the execute service's cache):")
            second = await load(stub, request)
        with gateway(args, services.exec.address, tmp) as (api_url, gateway_pid):
            rates = await sweep(services.exec.address, "bench", prompts, args, services.exec.process.pid, api_url,
                                gateway_pid, exec_api_port and f"http://127.0.0.1:{exec_api_port}")
        services.stop()
    except BaseException:
        print(services.log_tails())
        raise
    finally:
        services.cleanup()
    return {"cold_compile_s": cold_compile_s, "first_load": first, "second_load": second, "rates": rates}


def hf_run(args, prompts) -> dict:
    """transformers' continuous batching over the same prompts, same config, dummy weights, greedy."""
    import torch
    from transformers import GenerationConfig

    from kiln.model.causal_lm import build_model
    from kiln.model.spec import resolve

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


RATE_COLUMNS = ["backend", "request_rate", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "gpu_busy", "host_wait",
                "event_loop_cpu_ms_per_token", "other_threads_cpu_ms_per_token"]


def print_rate_table(rates: list[dict]) -> None:
    print("| backend | request rate (req/s) | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
          "| E2E p50 ms | E2E p99 ms | GPU busy | GPU waiting for the host | event loop CPU ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rates:
        cpu = r.get("event_loop_cpu_ms_per_token")
        print(f"| {r['backend']} | {r['request_rate']:g} | {r['output_throughput']:.0f} | {r['median_ttft_ms']:.1f} | "
              f"{r['p99_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} | {r['p99_itl_ms']:.2f} | "
              f"{r['median_e2el_ms']:.0f} | {r['p99_e2el_ms']:.0f} | {100 * r['gpu_busy']:.0f}% | "
              f"{100 * r['host_wait']:.0f}% | {'-' if cpu is None else f'{cpu:.4f}'} |")


def print_pass_medians(rates: list[dict]) -> None:
    """Each (backend, rate)'s median over its passes: what alternated passes compare."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in rates:
        groups.setdefault((r["backend"], r["request_rate"]), []).append(r)
    print("\n| backend | request rate (req/s) | passes | output tok/s, median | TTFT p50 ms, median |")
    print("|---|---|---|---|---|")
    for (backend, rate), runs in groups.items():
        print(f"| {backend} | {rate:g} | {len(runs)} | {statistics.median(r['output_throughput'] for r in runs):.0f} | "
              f"{statistics.median(r['median_ttft_ms'] for r in runs):.2f} |")


def write_rates(rates: list[dict], stem: Path, title: str) -> None:
    """The per-rate figures as CSV, and TTFT and ITL (p50, p99) against the rate as a PNG when matplotlib is here."""
    csv_path = stem.with_name(stem.name + "_rates.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, RATE_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rates)
    print(f"wrote {csv_path}")
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG; plot the CSV above")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r["request_rate"] for r in rates if not math.isinf(r["request_rate"])]
    inf_at = 2 * max(finite) if finite else 1.0  # "inf" sits one doubling right of the highest finite rate
    xs = [inf_at if math.isinf(r["request_rate"]) else r["request_rate"] for r in rates]
    fig, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((ttft_ax, "ttft", "TTFT (ms)"), (itl_ax, "itl", "inter-token latency (ms)")):
        ax.plot(xs, [r[f"median_{key}_ms"] for r in rates], marker="o", label="p50")
        ax.plot(xs, [r[f"p99_{key}_ms"] for r in rates], marker="o", linestyle="--", label="p99")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [("inf" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}") for r in rates])
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    png_path = stem.with_name(stem.name + "_rates.png")
    fig.savefig(png_path, dpi=120)
    print(f"wrote {png_path}")


def prefix_caching(args) -> bool:
    """Off when asked, or when backends are compared: each backend sends the same prompts, so a later one would be
    served from the prefix cache the earlier one filled."""
    return not args.no_prefix_caching and len(args.backend) == 1


def parse_rates(text: str) -> list[float]:
    return [float(r) for r in text.split(",")]


def parse_backends(text: str) -> list[str]:
    backends = [b.strip() for b in text.split(",") if b.strip()]
    unknown = sorted(set(backends) - {"grpc", "openai", "openai-exec"})
    if unknown or not backends:
        raise argparse.ArgumentTypeError(f"{text!r}: grpc, openai, openai-exec or several, comma-separated (a name "
                                         "again: a pass more, e.g. grpc,openai,grpc,openai alternates them)")
    return backends


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                   help="comma-separated requests/s, Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-waiting", type=int, default=0,
                   help="LoadModel's max_num_waiting (default: the service's, 256): a rate-inf run of more requests "
                        "than this plus --max-num-seqs sees the rest refused")
    p.add_argument("--stream-interval", type=int, default=0,
                   help="LoadModel's stream_interval (default: the service's, 1): tokens a stream sends at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--piecewise-capture-sizes", type=lambda t: [int(v) for v in t.split(",") if v.strip()],
                   default=[], help="LoadModel's piecewise_capture_sizes: comma-separated token counts, 0 for none "
                                    "(default: the service's)")
    p.add_argument("--exec-server", default="", help="a running execute service (default: start both locally)")
    p.add_argument("--model", default="", help="with --exec-server: the name of a model loaded there")
    p.add_argument("--backend", type=parse_backends, default=["grpc"],
                   help="grpc: Generate on the execute service; openai: streamed /v1/completions through kiln "
                        "api-server (started here in front of the execute service unless --api-url names one); "
                        "openai-exec: the same to the execute service's own endpoint (--openai-port); several, "
                        "comma-separated: each in turn, against the same loaded model; names repeated run more "
                        "passes in that order (grpc,openai,openai,grpc), so none always goes second")
    p.add_argument("--api-url", default="", help="with --backend openai: a running gateway, e.g. http://host:8000")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="load with prefix caching off (always, when --backend runs more than one pass)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quantization", default="", choices=["", "fp8"], help="fp8: the decoder's linears in FP8")
    p.add_argument("--quantize-head", action="store_true", help="with --quantization fp8: the head in FP8 too")
    p.add_argument("--kv-cache-dtype", default="", choices=["", "fp8_e4m3"], help="fp8_e4m3: an FP8 KV cache")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks, one GPU each (docs/tensor-parallel.md); with --skip-hf when one GPU cannot hold it")
    args = p.parse_args()
    if bool(args.exec_server) != bool(args.model):
        p.error("--exec-server and --model go together")
    rng = random.Random(args.seed)
    from kiln.model.spec import PRESETS

    vocab = PRESETS[args.preset]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    if args.api_url and "openai" not in args.backend:
        p.error("--api-url needs --backend openai")
    if args.exec_server and "openai-exec" in args.backend:
        p.error("--backend openai-exec: the bench starts the execute service with its endpoint; drop --exec-server")
    if args.exec_server:
        with tempfile.TemporaryDirectory() as tmp, gateway(args, args.exec_server, Path(tmp)) as (api_url, pid):
            result = {"rates": asyncio.run(sweep(args.exec_server, args.model, prompts, args, None, api_url, pid))}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = asyncio.run(kiln_run(args, prompts, Path(tmp)))
    if not args.skip_hf and not args.exec_server:
        try:
            result["hf"] = hf_run(args, prompts)
        except Exception as exc:  # noqa: BLE001 - the peer failing is a result to report, not a crash
            result["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
    setup = f", {args.quantization} linears" if args.quantization else ""
    setup += " and head" if args.quantize_head else ""
    setup += f", {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype else ""
    setup += f", tensor parallel {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    if not args.exec_server:
        setup += f", prefix caching {'on' if prefix_caching(args) else 'off'}"
    workload = (f"{args.preset} {args.dtype}{setup}, {args.requests} requests, prompts "
                f"{args.min_prompt}-{args.max_prompt}, {args.output_len} output tokens each, greedy, "
                f"{time.strftime('%Y-%m-%d')}")
    print(f"\n{workload}")
    if "first_load" in result:
        print("| phase | first LoadModel s (download) | second LoadModel s (cached) |")
        print("|---|---|---|")
        for phase in result["second_load"]["phases"]:
            print(f"| {phase} | {result['first_load']['phases'].get(phase, 0):.2f} | "
                  f"{result['second_load']['phases'][phase]:.2f} |")
        print()
    print_rate_table(result["rates"])
    if len(args.backend) > len(set(args.backend)):
        print_pass_medians(result["rates"])
    saturated = max(result["rates"], key=lambda r: r["request_rate"])
    hf = result.get("hf")
    if hf is not None:
        print("\n| system | output tokens | wall s | output tokens/s | vs transformers |")
        print("|---|---|---|---|---|")
        ratio = f"{saturated['output_throughput'] / hf['tokens_per_s']:.1f}x" if "tokens_per_s" in hf else "-"
        via = {"openai": "OpenAI gateway", "openai-exec": "the execute service's OpenAI endpoint"}.get(
            saturated["backend"], "gRPC")
        print(f"| Kiln ({via}, CUDA graphs), rate {saturated['request_rate']:g} | {saturated['output_tokens']} | "
              f"{saturated['duration_s']:.1f} | {saturated['output_throughput']:.0f} | {ratio} |")
        if "tokens_per_s" in hf:
            print(f"| transformers generate_batch | {hf['output_tokens']} | {hf['wall_s']:.1f} | "
                  f"{hf['tokens_per_s']:.0f} | 1.0x |")
        else:
            print(f"| transformers generate_batch | failed: {hf['error']} | | | |")
    print(f"\nforward stats at rate {saturated['request_rate']:g}: {saturated['forward_stats']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
        write_rates(result["rates"], args.json_out.with_suffix(""), workload)


if __name__ == "__main__":
    main()
