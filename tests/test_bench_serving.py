"""`bench/serving.py --request-rate` against the session's real execute service (and once with services of its
own): vLLM's result block per rate, the per-rate CSV, failures counted, and figures that hang together."""

import asyncio
import csv
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import load_model

ROOT = Path(__file__).parents[1]


def test_serving_bench_reports_each_rate_as_vllm_does(exec_server, tiny_loaded, tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "bench/serving.py", "--exec-server", exec_server.address, "--model", "tiny", "--preset",
         "tiny-llama", "--requests", "12", "--request-rate", "40,inf", "--min-prompt", "4", "--max-prompt", "40",
         "--output-len", "6", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = proc.stdout.split("Traffic request rate: ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["40.0", "inf"]
    for block in blocks:
        for label in ("Successful requests:", "Total generated tokens:", "Output token throughput (tok/s):",
                      "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median ITL (ms):", "P99 ITL (ms):",
                      "P99 E2EL (ms):", "GPU busy (forward time / wall) (%):",
                      "GPU waiting for the host, work queued (%):"):
            assert re.search(rf"^{re.escape(label)} +[\d.]+ *$", block, re.M), (label, block)
        assert re.search(r"^Successful requests: +12 *$", block, re.M)
        assert re.search(r"^Total generated tokens: +72 *$", block, re.M)

    rates = json.loads(out.read_text())["rates"]
    for r in rates:
        assert r["completed"] == 12 and r["output_tokens"] == 72
        assert 0 < r["host_wait"] < 1  # six steps a request: the later ones waited for the host's scheduling
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] <= r["p99_e2el_ms"]
        assert 0 < r["median_itl_ms"] <= r["p99_itl_ms"] and 0 < r["gpu_busy"] <= 1
        assert r["output_throughput"] == r["output_tokens"] / r["duration_s"]
    with open(tmp_path / "serving_rates.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["request_rate"] for row in rows] == ["40.0", "inf"]
    assert float(rows[1]["output_throughput"]) == rates[1]["output_throughput"]
    assert "| backend | request rate (req/s) | output tok/s | TTFT p50 ms" in proc.stdout


def test_requests_the_service_refuses_are_counted_as_failed_not_the_end_of_the_run(exec_server, exec_stub, tmp_path):
    """A rate-inf burst at a model whose queue holds one request: the refused ones are counted by their status, as
    vLLM's benchmark_serving counts failures, and every figure comes from the requests that were served."""
    load_model(exec_stub, "tiny-one-queued", max_num_seqs=1, max_num_waiting=1)
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "bench/serving.py", "--exec-server", exec_server.address, "--model", "tiny-one-queued",
         "--preset", "tiny-llama", "--requests", "12", "--request-rate", "inf", "--min-prompt", "4", "--max-prompt",
         "40", "--output-len", "6", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rate,) = json.loads(out.read_text())["rates"]
    assert rate["failed"] == rate["failures"]["RESOURCE_EXHAUSTED"] > 0
    assert rate["completed"] + rate["failed"] == 12 and rate["output_tokens"] == 6 * rate["completed"]
    assert re.search(rf"^Failed requests: +{rate['failed']} \(RESOURCE_EXHAUSTED {rate['failed']}\) *$",
                     proc.stdout, re.M)


def test_serving_bench_runs_grpc_and_the_openai_gateway_side_by_side(exec_server, tiny_loaded, tmp_path):
    """--backend grpc,openai,grpc: the same requests on gRPC, then through kiln api-server started in front of the
    execute service, then on gRPC again, against the same model: the same block for each pass, the gateway's with
    its CPU per token, and each backend's median over its passes."""
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "bench/serving.py", "--exec-server", exec_server.address, "--model", "tiny", "--preset",
         "tiny-llama", "--requests", "8", "--request-rate", "inf", "--min-prompt", "4", "--max-prompt", "40",
         "--output-len", "6", "--backend", "grpc,openai,grpc", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grpc_block, block, again = proc.stdout.split("Traffic request rate: ")[1:]
    assert re.search(r"^Backend: +grpc *$", grpc_block, re.M) and "API gateway" not in grpc_block
    assert re.search(r"^Total generated tokens: +48 *$", block, re.M)
    assert re.search(r"^Backend: +openai *$", block, re.M)
    assert re.search(r"^API gateway CPU per output token \(ms\): +[\d.]+ *$", block, re.M)
    assert re.search(r"^Backend: +grpc *$", again, re.M)
    assert re.search(r"^\| grpc \| inf \| 2 \| \d+ \| [\d.]+ \|$", proc.stdout, re.M)  # the medians over passes
    grpc_rate, rate, grpc_again = json.loads(out.read_text())["rates"]
    assert grpc_rate["backend"] == grpc_again["backend"] == "grpc" and grpc_rate["output_tokens"] == 48
    assert rate["completed"] == 8 and rate["output_tokens"] == 48 and rate["backend"] == "openai"
    assert 0 < rate["median_ttft_ms"] <= rate["p99_e2el_ms"]
    assert rate["gateway_cpu_ms_per_token"] >= 0  # clock ticks of 10 ms: a run this small may read 0


def test_the_bench_http_client_drops_a_kept_alive_connection_the_server_closed():
    """uvicorn closes a kept-alive connection idle past its timeout: the next request must not be written into it
    (alternated passes failed with "Connection lost"). A real socket server that answers one event, then closes."""
    sys.path.insert(0, str(ROOT / "bench"))
    from openai_stream import SseClient

    async def run() -> tuple[list, int]:
        connections = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
            await reader.readexactly(length)
            body = b'data: {"n": 1}\n\ndata: [DONE]\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            writer.close()  # as a keep-alive timeout closes it

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        client = SseClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        got = []
        for _ in range(2):
            got += [event async for event in client.events("/v1/completions", {"prompt": [1]})]
            await asyncio.sleep(0.1)  # the close reaches the client
        await client.close()
        server.close()
        return got, len(connections)

    got, connections = asyncio.run(run())
    assert got == [{"n": 1}, {"n": 1}] and connections == 2


def test_the_bench_loads_its_own_model_with_the_queue_bound_it_is_given(tmp_path):
    """Without --exec-server the bench starts its own compile and execute services and loads the model with its
    flags: with --max-num-waiting 4 and --max-num-seqs 2, a rate-inf burst of 24 sees most requests refused (the
    default bound, 256, would take them all)."""
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "bench/serving.py", "--device", "cpu", "--preset", "tiny-llama", "--dtype", "float32",
         "--requests", "24", "--request-rate", "inf", "--min-prompt", "4", "--max-prompt", "40", "--output-len", "4",
         "--max-num-seqs", "2", "--max-num-waiting", "4", "--max-num-batched-tokens", "64", "--skip-hf",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rate,) = json.loads(out.read_text())["rates"]
    assert rate["failures"] == {"RESOURCE_EXHAUSTED": rate["failed"]} and rate["failed"] > 0
    assert rate["completed"] + rate["failed"] == 24 and rate["output_tokens"] == 4 * rate["completed"]


def test_a_process_cpu_time_keeps_the_threads_that_have_ended():
    """The gateway's CPU per token is its whole process's: a thread that burnt CPU and ended is still counted (a sum
    over the live threads lost it, ~7% of the gateway's CPU), and the execute service's other threads are the
    process's time less its event loop's."""
    sys.path.insert(0, str(ROOT / "bench"))
    from serving import process_cpu_s, thread_cpu_s

    def burn() -> None:
        deadline = time.thread_time() + 0.3
        while time.thread_time() < deadline:
            pass

    before, threads_before = process_cpu_s(os.getpid()), thread_cpu_s(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()
    threads_after = thread_cpu_s(os.getpid())
    assert process_cpu_s(os.getpid()) - before >= 0.25  # clock ticks of 10 ms
    assert threads_after["other_threads"] - threads_before["other_threads"] >= 0.25
    assert threads_after["event_loop"] - threads_before["event_loop"] < 0.1
