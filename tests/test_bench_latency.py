"""`kiln bench latency` against the session's real execute service prints the latency and the PR's stats line."""

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import TINY_CONFIG
from google.protobuf import json_format

STATS_LINE = re.compile(r"Batchsize forward time stats \(batchsize, count, median_time\(ms\)\): \[(.*)\]")


def test_bench_latency_prints_the_forward_time_line(exec_server, tiny_loaded):
    """After the session's first load (tiny_loaded), which the startup-phase test expects to download."""
    config = json.dumps(json_format.MessageToDict(TINY_CONFIG))
    proc = subprocess.run(
        [sys.executable, "-m", "kiln_cli", "bench", "latency", "tiny-llama", "--exec-server", exec_server.address,
         "--batch-size", "3", "--input-len", "5", "--output-len", "6", "--num-iters", "2", "-O", config],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Avg latency: \d+\.\d+ seconds", proc.stdout)
    table = STATS_LINE.search(proc.stdout).group(1)
    rows = [tuple(float(x) for x in row.split(", ")) for row in re.findall(r"\(([^)]*)\)", table)]
    # Each sequence is in 6 steps an iteration (its prefill, then 5 decodes), in whatever batches the three happened
    # to share: 2 iterations × 3 sequences × 6 sequence-steps, however arrival timing grouped them. A batch size has
    # one entry per phase (prefill / decode / mixed).
    assert sum(int(batch_size) * int(count) for batch_size, count, _ in rows) == 2 * 3 * 6
    assert all(ms > 0 for _, _, ms in rows)


def test_bench_latency_rejects_a_bad_config(exec_server, tiny_loaded):
    proc = subprocess.run([sys.executable, "-m", "kiln_cli", "bench", "latency", "tiny-llama", "--exec-server",
                           exec_server.address, "-O", '{"no_such_field": 1}'], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "-O/--compile-config: not a CompileConfig" in proc.stderr
