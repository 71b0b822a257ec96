"""deploy/grafana/kiln-dashboard.json: importable (a Prometheus datasource input, unique panel ids, a grid that
fits), and every series it queries is one that Kiln's servers export, by name and suffix."""

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from compile_service.metrics import CompileMetrics
from exec_service.openai.gateway_metrics import GatewayMetrics
from exec_service.telemetry.metrics import ExecMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kiln-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_series() -> set[str]:
    registry = CollectorRegistry()
    for metrics in (ExecMetrics, CompileMetrics, GatewayMetrics):
        metrics(registry)
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_the_dashboard_imports_with_a_prometheus_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    (source,) = dashboard["__inputs"]
    assert source["pluginId"] == "prometheus"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${" + source["name"] + "}" and panel["targets"], panel["title"]


def test_every_queried_series_is_exported():
    exported = exported_series()
    queried = {name for panel in panels() for target in panel.get("targets", [])
               for name in re.findall(r"kiln:[a-z0-9_]+", target["expr"])}
    assert queried and queried <= exported, queried - exported
    # And each metric of the execute service is on the dashboard.
    families = {name.removesuffix(s) for name in queried for s in ("_total", "_bucket", "_sum", "_count")
                if name.endswith(s)} | queried
    assert {"kiln:time_to_first_token_seconds", "kiln:num_requests_waiting", "kiln:kv_blocks_used",
            "kiln:forward_time_seconds", "kiln:compiles", "kiln:num_preemptions"} <= families
