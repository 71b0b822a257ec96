"""`bench/request_overhead.py` on the tiny model: each lone request's TTFT split at its own prefill step, the three
parts in order on one clock (the client's sends and tokens, the engine's forward spans)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_each_request_splits_at_its_own_prefill(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, "bench/request_overhead.py", "--device", "cpu", "--preset", "tiny-llama", "--dtype",
         "float32", "--prompt-lens", "8,40", "--requests", "3", "--warmup", "1", "--output-len", "4", "--gap-s",
         "0.01", "--max-num-batched-tokens", "128", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    splits = json.loads(out.read_text())
    assert sorted(s["prompt_len"] for s in splits) == [8, 8, 8, 40, 40, 40]  # none without its prefill span
    for s in splits:
        assert s["before_ms"] > 0 and s["forward_ms"] > 0 and s["after_ms"] > 0, s  # send < start < end < token
        # 4 tokens: 3 decode steps; tokens that were ready together may come in one message, so up to 3 gaps
        assert len(s["decode_ms"]) == 3 and len(s["itl_ms"]) <= 3, s
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 8 |", "| 40 |"))]
    assert len(rows) == 2 and all(line.count("|") == 10 for line in rows), proc.stdout
