"""What the OpenAI gateway itself costs a request: lone streamed requests to a stub execute service that answers at
once, straight over gRPC and through a real ``kiln api-server`` in front of it, and the floor of any HTTP hop,
alternated.

The stub is a real grpc.aio server with Kiln's ExecService API whose Generate streams ``--output-len`` one-token
messages as fast as it can, with no model behind it: the difference between the two paths' first-token times is the
gateway's way in and out (HTTP parsing, validation, its gRPC call, the SSE chunk), the part of a request's TTFT
that ``bench/serving.py --backend grpc,openai`` cannot tell apart from the engine's at rate 1. The floor is a raw
ASGI app on the gateway's own uvicorn and HTTP parser answering the same request with the same events, precomputed,
and nothing behind it: what a hop over HTTP costs before any gateway code runs, so the gateway's own share is what
it adds past that. Each path's client is what bench/serving.py uses (grpc.aio; h11 with kept-alive connections).
Also reported: the gateway process's CPU time per request.

With ``--traced`` the gateway traces (its HTTP server spans and Generate client spans) to a real OTLP receiver in
this process, as it would to Jaeger: what tracing adds to its hop.

usage: python bench/gateway_overhead.py [--requests 200] [--warmup 20] [--gap-s 0.02] [--prompt-len 32]
                                       [--output-len 16] [--traced]
"""

import argparse
import asyncio
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import uvicorn
from openai_stream import SseClient
from serving import process_cpu_s

from exec_service.openai.http_limits import DEFAULT_LIMITS
from exec_service.openai.http_protocol import BoundedHttpToolsProtocol
from exec_service.openai.streaming import DONE, MEDIA_TYPE, ChunkStream
from kiln_cli.service_process import free_port, kiln_command
from protos import exec_pb2, exec_pb2_grpc
from tracing.otlp_receiver import OtlpReceiver

MODEL = "stub"


def stub_responses(prompt_len: int, output_len: int) -> list[exec_pb2.GenerateResponse]:
    return [exec_pb2.GenerateResponse(
        token_ids=[i + 1], finish_reason=exec_pb2.FINISH_REASON_LENGTH if i == output_len - 1 else 0,
        usage=exec_pb2.Usage(prompt_tokens=prompt_len, output_tokens=i + 1) if i == output_len - 1 else None)
        for i in range(output_len)]


class StubExec(exec_pb2_grpc.ExecServiceServicer):
    """Generate answers ``max_tokens`` messages of one token each, at once; every other call is unimplemented."""

    async def Generate(self, request, context):
        for response in stub_responses(len(request.prompt_ids), request.max_tokens):
            yield response


def serve_floor(port: int, prompt_len: int, output_len: int) -> None:
    """The floor: a raw ASGI app on the gateway's uvicorn and protocol that answers every POST with the events the
    gateway would send for the stub's answer, made once; any GET with an empty 200."""
    stream = ChunkStream(1, False, MODEL, False, include_usage=True, want_token_ids=True)
    events = [stream.chunk(0, response) for response in stub_responses(prompt_len, output_len)]
    events += [stream.usage_chunk(), DONE]
    head = f"{MEDIA_TYPE}; charset=utf-8".encode()  # as the gateway's EventStream says it

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            return await send({"type": "lifespan.shutdown.complete"})
        while (await receive()).get("more_body"):
            pass
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            return await send({"type": "http.response.body", "body": b""})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", head)]})
        for item in events:
            await send({"type": "http.response.body", "body": item, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    protocol = functools.partial(BoundedHttpToolsProtocol, limits=DEFAULT_LIMITS)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio", http=protocol,
                access_log=False)


def wait_until_answering(url: str, child: subprocess.Popen, log: Path) -> None:
    """Until the server answers HTTP (the gateway's /v1/models fails: the stub has no ListModels). In a thread: the
    stub answers on this process's event loop."""
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
    raise RuntimeError(f"{url} did not answer; see {log}")


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


PATHS = ("grpc", "openai", "floor")


async def run(args) -> None:
    server = grpc.aio.server()
    exec_pb2_grpc.add_ExecServiceServicer_to_server(StubExec(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    http_port, floor_port = free_port(), free_port()
    receiver = OtlpReceiver().start() if args.traced else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if receiver is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "ab") as log:
        child = subprocess.Popen(kiln_command("api-server", "--port", str(http_port), "--exec-server", address),
                                 env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        floor = subprocess.Popen([sys.executable, __file__, "--serve-floor", str(floor_port), "--prompt-len",
                                  str(args.prompt_len), "--output-len", str(args.output_len)],
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            clients = {}
            for path, process, http in (("openai", child, http_port), ("floor", floor, floor_port)):
                url = f"http://127.0.0.1:{http}"
                await asyncio.to_thread(wait_until_answering, url, process, Path(tmp) / "servers.log")
                clients[path] = SseClient(url)
            prompt = list(range(1, args.prompt_len + 1))
            times: dict[str, list[float]] = {path: [] for path in PATHS}
            gateway_cpu = 0.0
            async with grpc.aio.insecure_channel(address) as channel:
                stub = exec_pb2_grpc.ExecServiceStub(channel)
                for i in range(args.warmup + args.requests):
                    for path in PATHS if i % 2 else reversed(PATHS):
                        await asyncio.sleep(args.gap_s)
                        before = process_cpu_s(child.pid)
                        ttft = await (grpc_ttft(stub, prompt, args.output_len) if path == "grpc"
                                      else http_ttft(clients[path], prompt, args.output_len))
                        if i >= args.warmup:
                            times[path].append(ttft)
                            if path == "openai":
                                gateway_cpu += process_cpu_s(child.pid) - before
            for client in clients.values():
                await client.close()
        finally:
            for process in (child, floor):
                process.terminate()
                process.wait(timeout=30)
    await server.stop(None)
    traced = ""
    if receiver is not None:
        traced = f", the gateway traced ({len(receiver.spans())} spans received)"
        receiver.stop()
    p50 = {path: statistics.median(t) for path, t in times.items()}
    print(f"{args.requests} lone requests per path, alternated, {args.gap_s * 1e3:g} ms apart, {args.prompt_len} "
          f"prompt tokens, {args.output_len} one-token messages, stub execute service{traced}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| path | TTFT p50 ms | TTFT mean ms | p90 ms |")
    print("|---|---|---|---|")
    for path, t in times.items():
        print(f"| {path} | {p50[path]:.3f} | {statistics.fmean(t):.3f} | {statistics.quantiles(t, n=10)[-1]:.3f} |")
    added = p50["openai"] - p50["grpc"]
    print(f"\nthe gateway adds {added:.3f} ms to TTFT p50, of which an HTTP hop's floor is {p50['floor']:.3f} and "
          f"the gateway's own {added - p50['floor']:.3f}; its process's CPU {gateway_cpu / args.requests * 1e3:.2f} ms "
          f"per request ({args.output_len} chunks each)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--gap-s", type=float, default=0.02)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--traced", action="store_true", help="the gateway traces to an OTLP receiver in this process")
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the floor's own process
    args = p.parse_args()
    if args.serve_floor:
        serve_floor(args.serve_floor, args.prompt_len, args.output_len)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
