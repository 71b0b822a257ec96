"""``kiln bench latency``: vLLM's benchmark_latency for Kiln. A batch of prompts decoded together, timed end to end,
then the PR's forward-time line, so eager and compiled compare exactly as "[torch.compile] allow tracking forward
time" does: ``kiln bench latency MODEL --runtime-mode eager`` against ``-O '{"compile_sizes": [1]}'``."""

import ast
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from google.protobuf import json_format

from exec_service.api.runtime_modes import runtime_mode_to_proto
from exec_service.telemetry.forward_stats import stats_line
from kiln.rpc.client_security import PLAINTEXT, ClientSecurity
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.runtime_mode import RuntimeMode
from kiln_cli import security_args
from kiln_cli.compile_commands import DEFAULT_STORE, model_spec
from kiln_cli.output import report_rpc_error
from kiln_cli.service_process import LocalServices, ServiceFailed
from protos import common_pb2, exec_pb2, exec_pb2_grpc


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks against a running or a local execute service")
    kinds = p.add_subparsers(dest="bench", required=True)
    p = kinds.add_parser("latency", help="latency of one batch decoded together, and forward time per batch size")
    p.add_argument("model", help="a preset name or a local Hugging Face directory")
    p.add_argument("--exec-server", default="", help="an execute service to use (default: start both locally)")
    p.add_argument("--store", default=DEFAULT_STORE, help="artifact store of the local services")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("-O", "--compile-config", default="{}",
                   help="CompileConfig as JSON (or a Python dict literal), e.g. '{\"compile_sizes\": [1]}'")
    p.add_argument("--runtime-mode", type=RuntimeMode, choices=list(RuntimeMode), default=None,
                   help="default: the device's best")
    p.add_argument("--dtype", default="")
    p.add_argument("--max-num-seqs", type=int, default=0)
    p.add_argument("--kv-cache-bytes", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    security_args.add_client_args(p)  # towards --exec-server
    p.set_defaults(handler=run_latency)


def compile_config(text: str) -> common_pb2.CompileConfig:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        fields = ast.literal_eval(text)  # vLLM's examples write -O as a Python dict
    return json_format.ParseDict(fields, common_pb2.CompileConfig())


def run_latency(args) -> int:
    try:
        config = compile_config(args.compile_config)
    except (ValueError, SyntaxError, json_format.ParseError) as exc:
        print(f"error: -O: not a CompileConfig: {exc}", file=sys.stderr)
        return 2
    if args.exec_server:
        client = security_args.client_security(args)
        return _report(lambda: asyncio.run(_bench(args.exec_server, args, config, client)))
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    services = LocalServices(workdir, Path(args.store).expanduser())
    try:
        services.start(300)
        code = _report(lambda: asyncio.run(_bench(services.exec.address, args, config, PLAINTEXT)))
        services.stop()
        return code
    except ServiceFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        services.cleanup()


def _report(run) -> int:
    try:
        run()
        return 0
    except grpc.RpcError as exc:
        return report_rpc_error(exc)


async def _bench(address: str, args, config: common_pb2.CompileConfig, client: ClientSecurity) -> None:
    name = f"bench-latency-{args.runtime_mode or 'default'}"
    request = exec_pb2.LoadModelRequest(
        name=name, model=model_spec(args.model, args.dtype), config=config, max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_bytes,
        runtime_mode=runtime_mode_to_proto(args.runtime_mode))
    async with client.aio_channel(address, CHANNEL_OPTIONS) as channel:
        stub = exec_pb2_grpc.ExecServiceStub(channel)
        async for event in stub.LoadModel(request):
            if event.HasField("ready"):
                sizing = event.ready
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
        async for _ in stub.Generate(exec_pb2.GenerateRequest(model=name, prompt_ids=prompt, max_tokens=output_len,
                                                               temperature=0.0, ignore_eos=True)):
            pass

    started = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - started
