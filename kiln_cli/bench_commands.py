"""``kiln bench latency``: vLLM's benchmark_latency for Kiln. A batch of prompts decoded together, timed end to end,
then the PR's forward-time line, so eager and compiled compare exactly as "[torch.compile] allow tracking forward
time" does: ``kiln bench latency MODEL --runtime-mode eager`` against ``-O '{"compile_sizes": [1]}'``."""

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from exec_service.api.runtime_modes import runtime_mode_to_proto
from exec_service.telemetry.forward_stats import stats_line
from kiln.client.channels import connect_aio
from kiln.client.failures import EXEC_SERVICE
from kiln.client.generate import generate_async
from kiln.client.load import load_async
from kiln.client.requests import compile_config_from_text, model_spec
from kiln.rpc.client_security import PLAINTEXT, ClientSecurity
from kiln.runtime_mode import RuntimeMode
from kiln_cli import security_args
from kiln_cli.compile_commands import DEFAULT_STORE
from kiln_cli.output import report_rpc_error
from kiln_cli.service_process import LocalServices, ServiceFailed
from protos import common_pb2, exec_pb2, exec_pb2_grpc


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks against a running or a local execute service")
    kinds = p.add_subparsers(dest="bench", required=True)
    p = kinds.add_parser("latency", help="latency of one batch decoded together, and forward time per batch size")
    p.add_argument("model", help="a preset name or a local Hugging Face directory")
    p.add_argument("--server", "--exec-server", dest="server", default="", metavar="HOST:PORT",
                   help="an execute service to use (default: start both services locally)")
    p.add_argument("--store", default=DEFAULT_STORE, help="artifact store of the local services")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--input-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="batches run before the timed ones")
    p.add_argument("--num-iters", type=int, default=3, help="timed batches")
    p.add_argument("-O", "--compile-config", type=compile_config_arg, default=common_pb2.CompileConfig(),
                   metavar="JSON", help="CompileConfig as JSON (or a Python dict literal), e.g. "
                                        "'{\"compile_sizes\": [1]}' (default: {})")
    p.add_argument("--runtime-mode", type=RuntimeMode, choices=list(RuntimeMode), default=None,
                   help="how forwards run (default: the device's best)")
    p.add_argument("--dtype", default="", help="float32, bfloat16 or float16 (default: by device)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="most sequences in one step (default: 64)")
    p.add_argument("--kv-cache-bytes", type=int, default=0,
                   help="KV budget on CPU, a cap on CUDA (default: 64 MiB on CPU, no cap on CUDA)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    security_args.add_client_args(p)  # towards --server
    p.set_defaults(handler=run_latency)


def compile_config_arg(text: str) -> common_pb2.CompileConfig:
    """``-O``: as vLLM's examples write it, JSON or a Python dict."""
    try:
        return compile_config_from_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a CompileConfig: {exc}") from None


def run_latency(args) -> int:
    if args.server:
        security = security_args.client_security(args)
        return _report(lambda: asyncio.run(_bench(args.server, args, security)), args.server, security)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    services = LocalServices(workdir, Path(args.store).expanduser())
    try:
        services.start(300)
        code = _report(lambda: asyncio.run(_bench(services.exec.address, args, PLAINTEXT)), services.exec.address,
                       PLAINTEXT)
        services.stop()
        return code
    except ServiceFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        services.cleanup()


def _report(run, address: str, security: ClientSecurity) -> int:
    try:
        run()
        return 0
    except grpc.RpcError as exc:
        return report_rpc_error(exc, address, security, EXEC_SERVICE, "LoadModel")


async def _bench(address: str, args, security: ClientSecurity) -> None:
    name = f"bench-latency-{args.runtime_mode or 'default'}"
    request = exec_pb2.LoadModelRequest(
        name=name, model=model_spec(args.model, args.dtype), config=args.compile_config,
        max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes,
        runtime_mode=runtime_mode_to_proto(args.runtime_mode))
    async with connect_aio(address, security) as channel:
        stub = exec_pb2_grpc.ExecServiceStub(channel)
        sizing = await load_async(stub, request)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(sizing.vocab_size) for _ in range(args.input_len)] for _ in range(args.batch_size)]
        try:
            for _ in range(args.num_iters_warmup):
                await decode_batch(stub, name, prompts, args.output_len)
            await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=name, reset=True))
            latencies = [await decode_batch(stub, name, prompts, args.output_len) for _ in range(args.num_iters)]
            stats = (await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=name))).stats
        finally:
            await stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
    print(f"{args.model}: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
          f"{sizing.dtype} {sizing.runtime_mode} on {sizing.device}")
    print(f"Avg latency: {statistics.mean(latencies):.4f} seconds "
          f"(min {min(latencies):.4f}, max {max(latencies):.4f}, {len(latencies)} iterations)")
    print(stats_line(stats))


async def decode_batch(stub, name: str, prompts: list[list[int]], output_len: int) -> float:
    """Seconds until every prompt of the batch has its output_len tokens (greedy, ignore_eos)."""

    async def one(prompt):
        await generate_async(stub, exec_pb2.GenerateRequest(model=name, prompt_ids=prompt, max_tokens=output_len,
                                                            temperature=0.0, ignore_eos=True))

    started = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - started
