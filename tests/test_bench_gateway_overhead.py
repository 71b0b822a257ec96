"""`bench/gateway_overhead.py`: a real `kiln api-server` in front of the stub execute service, the same requests
straight over gRPC, and the HTTP hop's floor, each answering every request; with ``--traced`` the gateway's spans
reach the bench's OTLP receiver."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("traced", [False, True])
def test_three_paths_each_time_every_request(traced):
    proc = subprocess.run([sys.executable, "bench/gateway_overhead.py", "--requests", "6", "--warmup", "1",
                           "--gap-s", "0.005", "--output-len", "4", *(["--traced"] if traced else [])],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith(("| grpc |", "| openai |", "| floor |"))}
    assert set(rows) == {"grpc", "openai", "floor"}, proc.stdout
    for line in rows.values():
        assert all(float(cell) > 0 for cell in line.strip("|").split("|")[1:]), line
    summary = re.search(r"the gateway adds (-?[\d.]+) ms to TTFT p50, of which an HTTP hop's floor is ([\d.]+) and "
                        r"the gateway's own (-?[\d.]+); its process's CPU ([\d.]+) ms per request", proc.stdout)
    # The process's CPU time comes from /proc in clock ticks (10 ms): a few short requests may add up to none.
    assert summary is not None and float(summary[2]) > 0 and float(summary[4]) >= 0, proc.stdout
    spans = re.search(r"the gateway traced \((\d+) spans received\)", proc.stdout)
    if traced:  # each of the 7 requests a server span and a Generate client span (and the readiness probe's)
        assert spans is not None and int(spans[1]) >= 14, proc.stdout
    else:
        assert spans is None, proc.stdout
