"""``kiln demo``, the README's first command, run as a user runs it: a subprocess that must finish and exit 0."""

import os
import re
import subprocess
import sys

import pytest

from tracing.otlp_receiver import OtlpReceiver

# The bound for a fresh clone on a 2-core CPU, cold Inductor compile included.
DEMO_BUDGET_S = 300


@pytest.fixture(scope="module")
def otlp():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def demo(tmp_path_factory, otlp):
    """One demo run, tracing to a real OTLP receiver as it would to Jaeger."""
    store = tmp_path_factory.mktemp("demo-store")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp.endpoint
    result = subprocess.run([sys.executable, "-m", "kiln_cli", "demo", "--store", str(store), "--device", "cpu"],
                            capture_output=True, text=True, timeout=DEMO_BUDGET_S, env=env)
    return result, store


def test_demo_exits_0(demo):
    result, _ = demo
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_demo_names_no_log_folder_it_then_deletes(demo):
    """The service logs are kept, and named, only when the demo failed."""
    result, _ = demo
    assert "logs" not in result.stdout + result.stderr


def test_demo_prints_startup_phases_tokens_and_forward_times(demo):
    out = demo[0].stdout
    for phase in ("fetch", "load_weights", "profile_memory", "load_compiled"):
        assert re.search(rf"^\s+\d+\.\d\ds\s+{phase}\b", out, re.M), f"phase {phase} with its seconds:\n{out}"
    generated = re.findall(r"^  prompt (\d) \((\d+) tokens\) -> (\d+) tokens.*: \[([\d, ]+)\]$", out, re.M)
    assert [g[0] for g in generated] == ["0", "1", "2", "3"], out
    assert all(int(g[2]) == 16 and len(g[3].split(",")) == 16 for g in generated), out
    stats = re.search(r"^Batchsize forward time stats \(batchsize, count, median_time\(ms\)\): \[(.+)\]$", out, re.M)
    assert stats, out
    # Prompts sent at once are batched: some step ran several sequences together.
    batch_sizes = [int(b) for b in re.findall(r"\((\d+), \d+, \d+\.\d\d\)", stats[1])]
    assert batch_sizes and max(batch_sizes) > 1, stats[0]


def test_demo_stops_both_services_and_leaves_the_bundle(demo):
    result, store = demo
    assert "exec service stopped" in result.stdout and "compile service stopped" in result.stdout
    bundles = [p for p in store.iterdir() if not p.name.startswith(".")]
    assert len(bundles) == 1 and (bundles[0] / "manifest.json").is_file()


def test_demo_traces_to_the_otlp_endpoint(demo, otlp):
    """The demo is one trace rooted in its own span; the compile service, inheriting the endpoint, traces too."""
    (root,) = otlp.wait_for(lambda r: [s for s in r.spans() if s.name == "kiln demo"])
    assert root.resource["service.name"] == "kiln-demo" and root.parent_span_id == ""
    calls = {s.name for s in otlp.spans(root.trace_id) if s.kind == "CLIENT"}
    assert {"/kiln.v1.ExecService/LoadModel", "/kiln.v1.ExecService/Generate"} <= calls, calls
    compile_spans = {s.name for s in otlp.spans() if s.resource.get("service.name") == "kiln-compile"}
    assert {"compile", "trace", "split", "inductor", "save"} <= compile_spans, compile_spans


def test_demo_load_model_call_ends_inside_its_root_before_the_generates(demo, otlp):
    """The client's LoadModel span is read to its end: it closes before the first Generate, inside the root."""
    (root,) = otlp.wait_for(lambda r: [s for s in r.spans() if s.name == "kiln demo"])
    calls = [s for s in otlp.spans(root.trace_id) if s.kind == "CLIENT"]
    (load,) = [s for s in calls if s.name == "/kiln.v1.ExecService/LoadModel"]
    generates = [s for s in calls if s.name == "/kiln.v1.ExecService/Generate"]
    assert len(generates) == 4
    assert root.start_ns <= load.start_ns <= load.end_ns <= min(s.start_ns for s in generates)
    assert max(s.end_ns for s in calls) <= root.end_ns
