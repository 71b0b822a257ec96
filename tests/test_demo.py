"""``kiln demo``, the README's first command, run as a user runs it: a subprocess that must finish and exit 0."""

import re
import subprocess
import sys

import pytest

# The bound for a fresh clone on a 2-core CPU, cold Inductor compile included.
DEMO_BUDGET_S = 300


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    store = tmp_path_factory.mktemp("demo-store")
    result = subprocess.run([sys.executable, "-m", "kiln.cli", "demo", "--store", str(store), "--device", "cpu"],
                            capture_output=True, text=True, timeout=DEMO_BUDGET_S)
    return result, store


def test_demo_exits_0(demo):
    result, _ = demo
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_demo_prints_startup_phases_tokens_and_forward_times(demo):
    out = demo[0].stdout
    for phase in ("fetch", "load_weights", "profile_memory", "load_compiled"):
        assert re.search(rf"^\s+\d+\.\d\ds\s+{phase}\b", out, re.M), f"phase {phase} with its seconds:\n{out}"
    generated = re.findall(r"^  prompt (\d) \((\d+) tokens\) -> (\d+) tokens.*: \[([\d, ]+)\]$", out, re.M)
    assert [g[0] for g in generated] == ["0", "1", "2", "3"], out
    assert all(int(g[2]) == 16 and len(g[3].split(",")) == 16 for g in generated), out
    stats = re.search(r"^Batchsize forward time stats \(batchsize, count, median_time\(ms\)\): \[(.+)\]$", out, re.M)
    assert stats, out
    # Four prompts at once: some step ran all four sequences together.
    assert re.search(r"\(4, \d+, \d+\.\d\d\)", stats[1]), stats[0]


def test_demo_stops_both_services_and_leaves_the_bundle(demo):
    result, store = demo
    assert "exec service stopped" in result.stdout and "compile service stopped" in result.stdout
    bundles = [p for p in store.iterdir() if not p.name.startswith(".")]
    assert len(bundles) == 1 and (bundles[0] / "manifest.json").is_file()
