"""What the OpenAI gateway itself costs a request: lone streamed requests to a stub execute service that answers at
once, straight over gRPC and through a real ``kiln api-server`` in front of it, alternated.

The stub is a real grpc.aio server with Kiln's ExecService API whose Generate streams ``--output-len`` one-token
messages as fast as it can, with no model behind it: the difference between the two paths' first-token times is the
gateway's way in and out (HTTP parsing, validation, its gRPC call, the SSE chunk), the part of a request's TTFT
that ``bench/serving.py --backend grpc,openai`` cannot tell apart from the engine's at rate 1. Each path's client is
what bench/serving.py uses (grpc.aio; h11 with kept-alive connections). Also reported: the gateway process's CPU
time per request.

usage: python bench/gateway_overhead.py [--requests 200] [--warmup 20] [--gap-s 0.02] [--prompt-len 32]
                                       [--output-len 16]
"""

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from openai_stream import SseClient
from serving import process_cpu_s

from kiln_cli.service_process import free_port, kiln_command
from protos import exec_pb2, exec_pb2_grpc

MODEL = "stub"


class StubExec(exec_pb2_grpc.ExecServiceServicer):
    """Generate answers ``max_tokens`` messages of one token each, at once; every other call is unimplemented."""

    async def Generate(self, request, context):
        for i in range(request.max_tokens):
            last = i == request.max_tokens - 1
            yield exec_pb2.GenerateResponse(
                token_ids=[i + 1], finish_reason=exec_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=exec_pb2.Usage(prompt_tokens=len(request.prompt_ids), output_tokens=i + 1) if last else None)


def wait_until_answering(url: str, child: subprocess.Popen, log: Path) -> None:
    """Until the gateway answers HTTP (its /v1/models fails: the stub has no ListModels). In a thread: the stub
    answers on this process's event loop."""
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, ConnectionError):
            if child.poll() is not None:
                raise RuntimeError(log.read_text()) from None
            time.sleep(0.1)
    raise RuntimeError(f"kiln api-server did not answer; see {log}")


async def grpc_ttft(stub, prompt: list[int], output_len: int) -> float:
    started = time.perf_counter()
    first = None
    async for _ in stub.Generate(exec_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt, max_tokens=output_len)):
        first = first or time.perf_counter()
    return (first - started) * 1e3


async def http_ttft(client: SseClient, prompt: list[int], output_len: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    started = time.perf_counter()
    first = None
    async for _ in client.events("/v1/completions", body):
        first = first or time.perf_counter()
    return (first - started) * 1e3


async def run(args) -> None:
    server = grpc.aio.server()
    exec_pb2_grpc.add_ExecServiceServicer_to_server(StubExec(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    http_port = free_port()
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "api-server.log", "ab") as log:
        child = subprocess.Popen(kiln_command("api-server", "--port", str(http_port), "--exec-server", address),
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{http_port}"
            await asyncio.to_thread(wait_until_answering, url, child, Path(tmp) / "api-server.log")
            client = SseClient(url)
            prompt = list(range(1, args.prompt_len + 1))
            times: dict[str, list[float]] = {"grpc": [], "openai": []}
            gateway_cpu = 0.0
            async with grpc.aio.insecure_channel(address) as channel:
                stub = exec_pb2_grpc.ExecServiceStub(channel)
                for i in range(args.warmup + args.requests):
                    for path in ("grpc", "openai") if i % 2 else ("openai", "grpc"):
                        await asyncio.sleep(args.gap_s)
                        before = process_cpu_s(child.pid)
                        ttft = await (grpc_ttft(stub, prompt, args.output_len) if path == "grpc"
                                      else http_ttft(client, prompt, args.output_len))
                        if i >= args.warmup:
                            times[path].append(ttft)
                            if path == "openai":
                                gateway_cpu += process_cpu_s(child.pid) - before
            await client.close()
        finally:
            child.terminate()
            child.wait(timeout=30)
    await server.stop(None)
    p50 = {path: statistics.median(t) for path, t in times.items()}
    print(f"{args.requests} lone requests per path, alternated, {args.gap_s * 1e3:g} ms apart, {args.prompt_len} "
          f"prompt tokens, {args.output_len} one-token messages, stub execute service, {time.strftime('%Y-%m-%d')}")
    print("| path | TTFT p50 ms | TTFT mean ms | p90 ms |")
    print("|---|---|---|---|")
    for path, t in times.items():
        print(f"| {path} | {p50[path]:.3f} | {statistics.fmean(t):.3f} | {statistics.quantiles(t, n=10)[-1]:.3f} |")
    print(f"\nthe gateway adds {p50['openai'] - p50['grpc']:.3f} ms to TTFT p50; its process's CPU "
          f"{gateway_cpu / args.requests * 1e3:.2f} ms per request ({args.output_len} chunks each)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--gap-s", type=float, default=0.02)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
