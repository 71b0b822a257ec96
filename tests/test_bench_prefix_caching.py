"""`bench/prefix_caching.py` against the session's real execute service, on the tiny model: the three workloads run
with caching off and on, and their figures hang together (what a cache hit saves is counted, not timed)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_prefix_caching_bench_runs_each_workload_off_and_on(exec_server, tiny_key, tmp_path):
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [sys.executable, "bench/prefix_caching.py", "--exec-server", exec_server.address, "--preset", "tiny-llama",
         "--dtype", "", "--device", "cpu", "--compile-sizes", "8", "--max-num-batched-tokens", "128",
         "--max-num-seqs", "16", "--requests", "6", "--system-len", "48", "--unique-len", "8", "--output-len", "4",
         "--chats", "2", "--turns", "3", "--chat-new-tokens", "8", "--chat-output-len", "8", "--min-prompt", "4",
         "--max-prompt", "40", "--repeats", "2", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    shared, chat, unshared = results["shared_system_prompt"], results["multi_turn_chat"], results["no_shared_prefixes"]
    for workload in (shared, chat, unshared):
        assert workload["off"]["prompt_tokens_cached"] == 0 and workload["off"]["computed_fraction"] == 1.0
        assert workload["on"]["prompt_tokens_sent"] == workload["off"]["prompt_tokens_sent"]
    # The 48-token system prompt is 3 blocks: every request but the first to compute it finds them.
    assert shared["on"]["prompt_tokens_cached"] >= 5 * 48 and shared["on"]["output_throughput"] > 0
    # Turn k resends turns 1..k-1 (16 tokens each, 8 sent and 8 answered): all but the last answer's block hits.
    assert chat["off"]["prompt_tokens_sent"] == 2 * (8 + 24 + 40)
    assert chat["on"]["prompt_tokens_cached"] == 2 * (0 + 0 + 16)
    assert unshared["on"]["prompt_tokens_cached"] == 0  # each repeat sends prompts of its own
    assert len(unshared["on"]["runs_output_throughput"]) == 2
    assert results["prefix_cache"]["off"]["queried_tokens"] == 0 < results["prefix_cache"]["on"]["hit_tokens"]
    assert "| prefix caching | TTFT p50 ms |" in proc.stdout and "computed / sent" in proc.stdout
