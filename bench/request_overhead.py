"""Where a lone request's time to first token goes: before its prefill's forward, the forward, and after it.

Starts `kiln compile-server` and `kiln exec-server` on loopback (fresh store) with tracing to a receiver in this
process, loads the model, and sends requests one at a time with an idle gap between them (each prompt fresh, so
the prefix cache finds nothing; a few warm-up requests of each length first, not counted). Each request's prefill
step is its `forward` span (start: the host launching the forward, on the wall clock; length: the forward's device
time, CUDA events on a GPU), so its TTFT at the client splits into:

  send → step start     gRPC in, the handler, the engine's wake-up, scheduling, the step's inputs
  step (forward)        the prefill's forward, as the forward stats count it
  forward end → token   lm head and sampling, the token's way back to the host, the event loop, gRPC out

The first and last are what is not the forward. Also reported: the inter-token latency at the client against the
decode steps' forward time (the same split for the tokens after the first). The spans are exported after the run
(the span processors' schedule delay is set past its end), except the forward-span writer's full batches of 512,
which it exports from its own process.

The idle gap matters on its own: a host that idles between requests runs the next one's Python slower (on the CPU
host, every stage about twice as slow after 0.2 s idle as after 0.01 s; BENCHMARKS.md), so compare runs of one gap.

usage: python bench/request_overhead.py [--preset llama-3-8b] [--dtype bfloat16] [--device cuda]
                                        [--prompt-lens 32,256] [--requests 20] [--output-len 16] [--gap-s 0.2]
                                        [--json-out F]
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.client.channels import connect_aio
from kiln.client.compile import compile_model_async
from kiln.client.load import load_async, ready_line
from kiln.client.requests import compile_config, model_spec
from kiln.model.spec import PRESETS
from kiln_cli.service_process import LocalServices, child_environment
from protos import compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc
from tracing import spans
from tracing.otlp_receiver import OtlpReceiver

EXPORT_DELAY_MS = "3600000"  # the span processors' schedule delay: nothing is exported until the servers stop
SPANS_KEPT = "100000"  # the span processors' queue until then (past it, the oldest are dropped)


@dataclass
class Sent:
    """One request as the client saw it, on the wall clock (time.time_ns, as the spans are)."""

    prompt_len: int
    sent_ns: int
    arrivals_ns: list[int] = field(default_factory=list)  # each message that carried tokens


async def send(stub, model: str, prompt: list[int], output_len: int) -> Sent:
    sent = Sent(len(prompt), time.time_ns())
    async for response in stub.Generate(exec_pb2.GenerateRequest(model=model, prompt_ids=prompt,
                                                                  max_tokens=output_len, temperature=0.0,
                                                                  ignore_eos=True)):
        if response.token_ids:
            sent.arrivals_ns.append(time.time_ns())
    return sent


async def run(args, tmp: Path) -> tuple[list[Sent], list]:
    receiver = OtlpReceiver().start()
    env = {**child_environment(), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": EXPORT_DELAY_MS, "OTEL_BSP_MAX_QUEUE_SIZE": SPANS_KEPT}
    services = LocalServices(tmp, tmp / "store", env)
    rng = random.Random(args.seed)
    vocab = PRESETS[args.preset]["vocab_size"]
    try:
        services.start(300)
        spec = model_spec(args.preset, args.dtype)
        config = compile_config(args.device, max_compiled_tokens=args.max_num_batched_tokens)
        async with connect_aio(services.compile.address) as channel:
            await compile_model_async(compile_pb2_grpc.CompileServiceStub(channel),
                                      compile_pb2.CompileRequest(model=spec, config=config))
        request = exec_pb2.LoadModelRequest(
            name="bench", model=spec, config=config, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(args.prompt_lens) + args.output_len + 16,
            piecewise_capture_sizes=args.piecewise_capture_sizes)
        sent: list[Sent] = []
        async with connect_aio(services.exec.address) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            print(ready_line(await load_async(stub, request)), flush=True)
            for length in args.prompt_lens:
                for counted in [False] * args.warmup + [True] * args.requests:
                    prompt = [rng.randrange(vocab) for _ in range(length)]
                    one = await send(stub, "bench", prompt, args.output_len)
                    if counted:
                        sent.append(one)
                    await asyncio.sleep(args.gap_s)
        services.stop()  # the exec service's writers export every span before it exits
    except BaseException:
        print(services.log_tails())
        raise
    finally:
        services.cleanup()
    sent_in_all = len(args.prompt_lens) * (args.warmup + args.requests)  # each has a prefill span at least
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(prefills(receiver.spans())) < sent_in_all:
        await asyncio.sleep(0.2)
    receiver.stop()
    return sent, forwards(receiver.spans())


def forwards(received) -> list:
    return sorted((s for s in received if s.name == spans.FORWARD), key=lambda s: s.start_ns)


def prefills(received) -> list:
    return [s for s in forwards(received) if s.attributes[spans.PHASE] == "prefill"]


@dataclass(frozen=True)
class Split:
    """One request's TTFT in its three parts, and its later tokens against their decode steps; milliseconds."""

    prompt_len: int
    before_ms: float  # send → the prefill's forward starts
    forward_ms: float
    after_ms: float  # the forward's end → the first token at the client
    itl_ms: list[float]  # between the messages after the first
    decode_ms: list[float]  # the forwards of the request's decode steps

    @property
    def ttft_ms(self) -> float:
        return self.before_ms + self.forward_ms + self.after_ms


def split(sent: Sent, steps: list) -> Split | None:
    """None when no prefill step of the request's prompt length ran between its send and its first token."""
    first = sent.arrivals_ns[0]
    mine = [s for s in steps if sent.sent_ns <= s.start_ns and s.end_ns <= sent.arrivals_ns[-1]]
    prefill = [s for s in mine if s.attributes[spans.PHASE] == "prefill" and s.end_ns <= first
               and s.attributes[spans.NUM_TOKENS] == sent.prompt_len]
    if not prefill:
        return None
    step, ms = prefill[-1], 1e-6
    return Split(sent.prompt_len, (step.start_ns - sent.sent_ns) * ms, (step.end_ns - step.start_ns) * ms,
                 (first - step.end_ns) * ms,
                 [(b - a) * ms for a, b in zip(sent.arrivals_ns, sent.arrivals_ns[1:], strict=False)],
                 [(s.end_ns - s.start_ns) * ms for s in mine if s.attributes[spans.PHASE] == "decode"])


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({statistics.fmean(values):.2f})" if values else "-"


def report(splits: list[Split], missing: int, args) -> None:
    print(f"\n{args.preset} {args.dtype} on {args.device}, lone requests {args.gap_s} s apart, {args.output_len} "
          f"output tokens, greedy, fresh prompts (no prefix-cache hits), {time.strftime('%Y-%m-%d %H:%M')}; p50 "
          f"(mean) ms over {args.requests} requests each")
    print("| prompt tokens | TTFT | send → step start | step (forward) | forward end → token | not the forward | "
          "ITL | decode forward | ITL − decode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.prompt_lens:
        rows = [r for r in splits if r.prompt_len == length]
        if not rows:
            print(f"| {length} | no prefill spans found | | | | | | | |")
            continue
        itl = [gap for r in rows for gap in r.itl_ms]
        decode = [ms for r in rows for ms in r.decode_ms]
        gap = f"{statistics.median(itl) - statistics.median(decode):.2f}" if itl and decode else "-"
        print(f"| {length} | {cell([r.ttft_ms for r in rows])} | {cell([r.before_ms for r in rows])} | "
              f"{cell([r.forward_ms for r in rows])} | {cell([r.after_ms for r in rows])} | "
              f"{cell([r.before_ms + r.after_ms for r in rows])} | {cell(itl)} | {cell(decode)} | {gap} |")
    if missing:
        print(f"({missing} requests had no prefill span of their prompt length and are left out)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-lens", type=lambda t: [int(v) for v in t.split(",")], default=[32, 256])
    p.add_argument("--requests", type=int, default=20, help="counted requests per prompt length")
    p.add_argument("--warmup", type=int, default=3, help="requests per prompt length sent first, not counted")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--gap-s", type=float, default=0.2, help="idle time between requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--piecewise-capture-sizes", type=lambda t: [int(v) for v in t.split(",") if v.strip()],
                   default=[], help="LoadModel's piecewise_capture_sizes (default: the service's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="every counted request's split, as JSON")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sent, steps = asyncio.run(run(args, Path(tmp)))
    found = [split(s, steps) for s in sent]
    splits = [s for s in found if s is not None]
    report(splits, len(found) - len(splits), args)
    if args.json_out:
        args.json_out.write_text(json.dumps([{**asdict(s), "ttft_ms": s.ttft_ms} for s in splits], indent=1))


if __name__ == "__main__":
    main()
