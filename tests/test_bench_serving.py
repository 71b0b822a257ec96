"""`bench/serving.py --request-rate` against the session's real execute service: vLLM's result block per rate, the
per-rate CSV, and figures that hang together."""

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

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
                      "P99 E2EL (ms):", "GPU busy (forward time / wall) (%):"):
            assert re.search(rf"^{re.escape(label)} +[\d.]+ *$", block, re.M), (label, block)
        assert re.search(r"^Successful requests: +12 *$", block, re.M)
        assert re.search(r"^Total generated tokens: +72 *$", block, re.M)

    rates = json.loads(out.read_text())["rates"]
    for r in rates:
        assert r["completed"] == 12 and r["output_tokens"] == 72
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] <= r["p99_e2el_ms"]
        assert 0 < r["median_itl_ms"] <= r["p99_itl_ms"] and 0 < r["gpu_busy"] <= 1
        assert r["output_throughput"] == r["output_tokens"] / r["duration_s"]
    with open(tmp_path / "serving_rates.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["request_rate"] for row in rows] == ["40.0", "inf"]
    assert float(rows[1]["output_throughput"]) == rates[1]["output_throughput"]
    assert "| backend | request rate (req/s) | output tok/s | TTFT p50 ms" in proc.stdout


def test_serving_bench_runs_grpc_and_the_openai_gateway_side_by_side(exec_server, tiny_loaded, tmp_path):
    """--backend grpc,openai: the same requests on gRPC, then through kiln api-server started in front of the
    execute service, against the same model: the same block for each, the gateway's with its CPU per token."""
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "bench/serving.py", "--exec-server", exec_server.address, "--model", "tiny", "--preset",
         "tiny-llama", "--requests", "8", "--request-rate", "inf", "--min-prompt", "4", "--max-prompt", "40",
         "--output-len", "6", "--backend", "grpc,openai", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grpc_block, block = proc.stdout.split("Traffic request rate: ")[1:]
    assert re.search(r"^Backend: +grpc *$", grpc_block, re.M) and "API gateway" not in grpc_block
    assert re.search(r"^Total generated tokens: +48 *$", block, re.M)
    assert re.search(r"^Backend: +openai *$", block, re.M)
    assert re.search(r"^API gateway CPU per output token \(ms\): +[\d.]+ *$", block, re.M)
    grpc_rate, rate = json.loads(out.read_text())["rates"]
    assert grpc_rate["backend"] == "grpc" and grpc_rate["output_tokens"] == 48
    assert rate["completed"] == 8 and rate["output_tokens"] == 48 and rate["backend"] == "openai"
    assert 0 < rate["median_ttft_ms"] <= rate["p99_e2el_ms"]
    assert rate["gateway_cpu_ms_per_token"] >= 0  # clock ticks of 10 ms: a run this small may read 0
