"""What tracing costs decode throughput, and whether forward spans tell the same time as the engine's CUDA events.

`kiln bench latency`-style batches (--batch-sizes prompts of --input-len random tokens, --output-len tokens each,
greedy, ignore_eos) through the real gRPC servers, started as `LocalServices` child processes on one store:

1. tracing off: the services get no OTEL_* variables;
2. tracing on: OTLP to a receiver (tracing/otlp_receiver.py, the protocol Jaeger ingests) in a process of its own,
   as Jaeger is, so decoding spans does not slow this process's client; KILN_FORWARD_SPAN_RATIO=1.0, so every
   step is a span;
3. the same execute service after that receiver is stopped: every export fails, and serving must not slow down;
4. for each of --other-ratios, tracing on with that KILN_FORWARD_SPAN_RATIO (0 leaves request and gRPC spans only,
   which tells the forward spans' share of the cost from the rest).

For each batch size: output tokens/s (batch x output_len / mean batch latency) against run 1; in run 2, the forward
spans of the timed batches against GetForwardStats (CUDA events on GPU): the same count per batch size, and medians
within 5%. Exits 1 when they disagree. Prints a markdown table last.

usage: python bench/tracing_overhead.py [--preset llama-3-8b] [--batch-sizes 1,32]          (GPU: CUDA graphs)
       python bench/tracing_overhead.py --preset tiny-llama --device cpu                     (a check that it runs)
"""

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.client.channels import connect_aio
from kiln.client.load import load_async, phase_line
from kiln.client.requests import compile_config, model_spec
from kiln_cli.bench_commands import decode_batch
from kiln_cli.service_process import LocalServices, child_environment
from protos import exec_pb2, exec_pb2_grpc
from tracing import spans
from tracing.otlp_receiver import OtlpReceiver

MODEL = "bench-tracing"
AGREEMENT = 0.05  # forward-span median vs CUDA-event median
SPAN_WAIT_S = 60  # the exporter sends every 5 s by default


@dataclass
class Measured:
    """One batch size under one tracing setting."""

    tokens_per_s: float
    latency_s: float
    stats: list  # GetForwardStats rows of the timed batches
    window_ns: tuple[int, int]  # wall clock around the timed batches, to find their forward spans
    spans_count: dict[int, int] = field(default_factory=dict)  # by batch size (tracing on only)
    spans_median_ms: dict[int, float] = field(default_factory=dict)


async def measure(stub, args, vocab_size: int) -> dict[int, Measured]:
    results = {}
    for batch_size in args.batch_sizes:
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(batch_size)]
        for _ in range(args.num_iters_warmup):
            await decode_batch(stub, MODEL, prompts, args.output_len)
        await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=MODEL, reset=True))
        start_ns = time.time_ns()
        latencies = [await decode_batch(stub, MODEL, prompts, args.output_len) for _ in range(args.num_iters)]
        end_ns = time.time_ns()
        stats = (await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=MODEL))).stats
        latency = statistics.mean(latencies)
        results[batch_size] = Measured(batch_size * args.output_len / latency, latency, list(stats),
                                       (start_ns, end_ns))
        print(f"  batch {batch_size:3d}: {results[batch_size].tokens_per_s:10.1f} output tokens/s "
              f"(mean latency {latency:.3f} s over {args.num_iters})", flush=True)
    return results


async def load(stub, args) -> int:
    """LoadModel (compiling on the first run, a store hit after); returns the vocabulary size."""
    mode = exec_pb2.RUNTIME_MODE_CUDAGRAPH if args.device == "cuda" else exec_pb2.RUNTIME_MODE_COMPILED
    request = exec_pb2.LoadModelRequest(
        name=MODEL, model=model_spec(args.preset, args.dtype), config=compile_config(args.device),
        runtime_mode=mode, max_num_seqs=max(args.batch_sizes), max_model_len=args.input_len + args.output_len + 16)

    def phase(p: exec_pb2.StartupPhase) -> None:
        if not p.progress:
            print(phase_line(p), flush=True)

    return (await load_async(stub, request, phase)).vocab_size


def services_env(endpoint: str | None, ratio: float = 1.0) -> dict:
    env = {k: v for k, v in child_environment().items() if not k.startswith(("OTEL_", "KILN_FORWARD_SPAN_RATIO"))}
    if endpoint:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, KILN_FORWARD_SPAN_RATIO=str(ratio))
    return env


async def run_services(workdir: Path, store: Path, env: dict, args, phases) -> list[dict[int, Measured]]:
    """Start both services, load the model, then for each of ``phases`` measure every batch size on the same loaded
    model. A phase is a label and an action run before it, given the results so far."""
    services = LocalServices(workdir, store, env)
    try:
        services.start(300)
        async with connect_aio(services.exec.address) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            vocab_size = await load(stub, args)
            results = []
            for label, before in phases:
                before(results)
                print(f"{label}:", flush=True)
                results.append(await measure(stub, args, vocab_size))
        services.stop()
        return results
    finally:
        services.cleanup()


class ReceiverProcess:
    """tracing/otlp_receiver.py's OtlpReceiver, run in a spawned process and asked for its spans over a pipe."""

    def __init__(self):
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._process = spawn.Process(target=_run_receiver, args=(child,), daemon=True)
        self._process.start()
        self.endpoint = self._conn.recv()

    def spans(self) -> list:
        self._conn.send("spans")
        return self._conn.recv()

    def stop(self) -> None:
        if self._process.is_alive():
            self._conn.send("stop")
            self._process.join(30)


def _run_receiver(conn) -> None:
    receiver = OtlpReceiver().start()
    conn.send(receiver.endpoint)
    while conn.recv() == "spans":
        conn.send(receiver.spans())
    receiver.stop()


def forward_spans(receiver: ReceiverProcess, window_ns: tuple[int, int]) -> list:
    return [s for s in receiver.spans() if s.name == spans.FORWARD and s.attributes.get(spans.MODEL) == MODEL
            and window_ns[0] <= s.start_ns <= window_ns[1]]


def check_spans(receiver: ReceiverProcess, measured: dict[int, Measured]) -> None:
    """Wait for the timed batches' forward spans, then fill in their count and median per batch size."""
    for m in measured.values():
        expected = {s.batch_size: s.count for s in m.stats}
        deadline = time.monotonic() + SPAN_WAIT_S
        while True:
            got = forward_spans(receiver, m.window_ns)
            m.spans_count = {b: sum(s.attributes[spans.BATCH_SIZE] == b for s in got) for b in expected}
            if m.spans_count == expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for b in expected:
            durations = [(s.end_ns - s.start_ns) / 1e6 for s in got if s.attributes[spans.BATCH_SIZE] == b]
            if durations:
                m.spans_median_ms[b] = statistics.median(durations)


def table(args, off, on, others) -> tuple[str, bool]:
    """The markdown table, and whether forward spans agreed with the engine's times everywhere.

    ``others`` are (label, results) rows measured after ``on`` (the stopped receiver, other ratios)."""
    agreed = True
    lines = [f"{args.preset} on {args.device}, input {args.input_len}, output {args.output_len}, "
             f"{args.num_iters} timed batches each, {time.strftime('%Y-%m-%d')}", "",
             "| batch | tracing | output tokens/s | vs off | forward spans / steps | span median ms "
             "| engine median ms | span vs engine |", "|---|---|---|---|---|---|---|---|"]
    for b in args.batch_sizes:
        base = off[b].tokens_per_s
        rows = [("off", off[b]), ("on, ratio 1.0", on[b])] + [(label, results[b]) for label, results in others]
        for label, m in rows:
            engine = next((s for s in m.stats if s.batch_size == b), None)
            vs = "-" if m is off[b] else f"{(m.tokens_per_s - base) / base * 100:+.1f}%"
            steps = sum(s.count for s in m.stats)
            spans_cell = median_cell = delta_cell = "-"
            if m is on[b]:
                spans_cell = f"{sum(m.spans_count.values())} / {steps}"
                agreed &= m.spans_count == {s.batch_size: s.count for s in m.stats}
                if engine is not None and b in m.spans_median_ms:
                    delta = (m.spans_median_ms[b] - engine.median_ms) / engine.median_ms
                    agreed &= abs(delta) <= AGREEMENT
                    median_cell, delta_cell = f"{m.spans_median_ms[b]:.3f}", f"{delta * 100:+.2f}%"
                else:
                    agreed = False
            lines.append(f"| {b} | {label} | {m.tokens_per_s:.1f} | {vs} | {spans_cell} | {median_cell} "
                         f"| {engine.median_ms if engine else float('nan'):.3f} | {delta_cell} |")
    return "\n".join(lines), agreed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--store", type=Path, default=None, help="artifact store to reuse (default: a fresh one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--other-ratios", default="", help="more KILN_FORWARD_SPAN_RATIO values to measure, e.g. 0,0.1")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    other_ratios = [float(r) for r in args.other_ratios.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="kiln-tracing-bench-") as tmp:
        tmp = Path(tmp)
        store = args.store or tmp / "store"
        (tmp / "off").mkdir()
        (tmp / "on").mkdir()
        (off,) = asyncio.run(run_services(tmp / "off", store, services_env(None), args,
                                          [("tracing off", lambda results: None)]))

        receiver = ReceiverProcess()

        def stop_receiver(results):
            check_spans(receiver, results[0])  # the spans of the run before, all in
            receiver.stop()

        try:
            others = []
            for ratio in other_ratios:
                (tmp / f"ratio-{ratio}").mkdir()
                label = f"on, ratio {ratio:g}"
                (results,) = asyncio.run(run_services(tmp / f"ratio-{ratio}", store,
                                                      services_env(receiver.endpoint, ratio), args,
                                                      [(f"tracing {label}", lambda results: None)]))
                others.append((label, results))
            on, stopped = asyncio.run(run_services(
                tmp / "on", store, services_env(receiver.endpoint), args,
                [("tracing on (ratio 1.0)", lambda results: None), ("tracing on, receiver stopped", stop_receiver)]))
        finally:
            receiver.stop()
    text, agreed = table(args, off, on, [("on, receiver stopped", stopped), *others])
    print()
    print(text)
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
