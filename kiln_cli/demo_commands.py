"""``kiln demo``: the whole system on loopback, no Docker: both services as child processes, one model loaded,
a few prompts generated at once, the forward-time table, then a clean shutdown."""

import asyncio
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from exec_service.telemetry.forward_stats import stats_line
from kiln.client.generate import generate_async
from kiln.client.load import load_async, phase_line, ready_line
from kiln.client.requests import compile_config, model_spec
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln_cli.compile_commands import DEFAULT_STORE
from kiln_cli.output import report_rpc_error
from kiln_cli.service_process import LocalServices, ServiceFailed
from protos import exec_pb2, exec_pb2_grpc

# A real model's config where a GPU can run it; the CI-sized one on a CPU.
GPU_PRESET = "llama-3.2-1b"
CPU_PRESET = "tiny-llama"
# Different lengths, so the first steps mix prefills of several sizes before the decodes batch up.
PROMPT_LENGTHS = (5, 12, 23, 40, 7, 31, 16, 9)
DEMO_SPAN = "kiln demo"


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run both services locally, load a model, generate, show forward times")
    p.add_argument("--model", default="",
                   help=f"preset to serve (default: {GPU_PRESET} on a GPU, {CPU_PRESET} on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="", help="default: cuda when there is one")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--store", default=DEFAULT_STORE,
                       help="artifact store kept between runs, so a second demo is a cache hit (default: %(default)s)")
    store.add_argument("--temp-store", action="store_true",
                       help="a fresh store in a temporary directory, removed at exit: a cold compile every run")
    p.add_argument("--prompts", type=int, default=4, choices=range(1, len(PROMPT_LENGTHS) + 1), metavar="N",
                   help=f"prompts generated concurrently, 1 to {len(PROMPT_LENGTHS)} (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds each service may take to report SERVING (default: %(default)s)")
    p.set_defaults(handler=run_demo)


def run_demo(args) -> int:
    device = args.device or _default_device()
    model = args.model or (GPU_PRESET if device == "cuda" else CPU_PRESET)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-demo-"))
    store = workdir / "store" if args.temp_store else Path(args.store).expanduser()
    services = LocalServices(workdir, store)
    failed = True
    try:
        _say(f"kiln demo: {model} on {device}; store {store}")
        services.start(args.startup_timeout, lambda service, seconds: _say(
            f"{service.name} service serving at {service.address} ({seconds:.1f}s)"))
        from tracing.setup import init_tracing  # imports torch: not at module level, where `kiln health` pays

        telemetry = init_tracing("kiln-demo")
        try:
            asyncio.run(_exercise(services.exec.address, model, device, args.prompts, args.max_tokens))
        finally:
            telemetry.shutdown()
        services.stop(lambda service: _say(f"{service.name} service stopped"))
        failed = False
        return 0
    except grpc.RpcError as exc:
        return report_rpc_error(exc)
    except ServiceFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stop_services(services)
        if failed:
            print(f"service logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def stop_services(services: LocalServices) -> None:
    """After a failure or a Ctrl-C: stop what still runs, gracefully; a second Ctrl-C while they stop kills them at
    once, with a line rather than a traceback."""
    try:
        services.cleanup()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kill takes a moment; a third Ctrl-C changes nothing
        print("interrupted again: killing the services", file=sys.stderr)
        services.kill()


async def _exercise(address: str, model: str, device: str, num_prompts: int, max_tokens: int) -> None:
    """Under one root span, so with OTEL_EXPORTER_OTLP_ENDPOINT set the whole demo is one trace."""
    from tracing.grpc_instrumentation import instrumented_aio_channel
    from tracing.spans import tracer

    with tracer.start_as_current_span(DEMO_SPAN):
        async with instrumented_aio_channel(address, CHANNEL_OPTIONS) as channel:  # client spans in the demo's trace
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            sizing = await _load(stub, model, device)
            rng = random.Random(0)
            prompts = [[rng.randrange(3, sizing.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS[:num_prompts]]
            await _generate_all(stub, model, prompts, max_tokens)
            await _print_forward_stats(stub, model)


async def _load(stub, model: str, device: str) -> exec_pb2.ModelSizing:
    """LoadModel, printing each startup phase as it streams; returns the sizing of the ready model."""
    _say(f"\nloading {model} (a cold compile takes a minute or more; a cache hit, seconds)")
    request = exec_pb2.LoadModelRequest(name=model, model=model_spec(model), config=compile_config(device))
    sizing = await load_async(stub, request, lambda phase: _say(phase_line(phase)))
    _say(ready_line(sizing))
    return sizing


async def _generate_all(stub, model: str, prompts: list[list[int]], max_tokens: int) -> None:
    _say(f"\ngenerating {max_tokens} tokens for {len(prompts)} prompts at once (greedy)")
    started = time.monotonic()
    results = await asyncio.gather(*(_generate(stub, model, p, max_tokens) for p in prompts))
    elapsed = time.monotonic() - started
    for i, (prompt, (tokens, usage)) in enumerate(zip(prompts, results, strict=True)):
        _say(f"  prompt {i} ({len(prompt)} tokens) -> {len(tokens)} tokens, first after "
             f"{usage.time_to_first_token_s:.3f}s, done after {usage.total_s:.3f}s: {tokens}")
    total = sum(len(tokens) for tokens, _ in results)
    _say(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s)")


async def _generate(stub, model: str, prompt: list[int], max_tokens: int) -> tuple[list[int], exec_pb2.Usage]:
    request = exec_pb2.GenerateRequest(model=model, prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True)
    generation = await generate_async(stub, request)
    return generation.token_ids, generation.usage


async def _print_forward_stats(stub, model: str) -> None:
    stats = (await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=model))).stats
    _say("\n" + stats_line(stats))
    for s in stats:
        _say(f"  batch {s.batch_size:3d} {s.phase:<7} {s.path:<15}: {s.count:4d} forwards, "
             f"median {s.median_ms:8.2f} ms, p90 {s.p90_ms:8.2f} ms, {s.runtime_mode}")


def _default_device() -> str:
    import torch  # only here: the other commands should not pay for importing it

    return "cuda" if torch.cuda.is_available() else "cpu"


def _say(text: str) -> None:
    """The demo's output is its product, so it goes to stdout, unbuffered, not to the log."""
    print(text, flush=True)
