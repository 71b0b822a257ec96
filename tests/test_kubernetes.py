"""deploy/kubernetes/ proven without a cluster: every object against the Kubernetes API schemas of the stated version
(kubernetes-validate ships them, offline), and the structure the README promises: GPUs, probes on the ports the
servers listen on, per-model readiness for the model the replica loads, the signing key only where it signs, non-root
pods, resource requests, and container arguments the kiln CLI itself accepts."""

import argparse
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from kiln_cli import COMMAND_MODULES
from protos import exec_pb2

# From the test extra (kubernetes-validate, pyyaml): without it, as on a GPU machine running `pytest -m gpu`, this
# module is skipped rather than failing the whole collection.
kubernetes_validate = pytest.importorskip("kubernetes_validate", exc_type=ImportError)
yaml = pytest.importorskip("yaml", exc_type=ImportError)

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"  # grpc probes' `mode: TLS` is new in 1.37


def documents(paths) -> list[dict]:
    return [doc for path in sorted(paths) for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def applied() -> dict[tuple[str, str], dict]:
    """What `kubectl apply -f deploy/kubernetes/` creates (not recursive: secrets/ holds templates), by kind and
    name."""
    docs = documents(MANIFESTS.glob("*.yaml"))
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(objects) == len(docs), "no kind and name twice"
    return objects


def container(objects, name: str) -> dict:
    (only,) = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def kiln_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    subparsers = parser.add_subparsers()
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def test_every_object_validates_against_the_kubernetes_schemas():
    docs = documents([*MANIFESTS.glob("*.yaml"), *MANIFESTS.glob("secrets/*.yaml")])
    assert {d["kind"] for d in docs} == {"Namespace", "Service", "StatefulSet", "Deployment", "Secret"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_what_the_api_server_rejects(applied):
    """The schemas are not vacuous: a misspelt probe field and a string where a number goes both fail."""
    misspelt = json.loads(json.dumps(applied[("Deployment", "kiln-exec")]))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["sevice"] = "x"
    wrong_type = json.loads(json.dumps(applied[("Deployment", "kiln-exec")]))
    wrong_type["spec"]["replicas"] = "two"
    for doc in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_exec_runs_two_gpu_replicas_and_compile_one_gpu(applied):
    assert applied[("Deployment", "kiln-exec")]["spec"]["replicas"] == 2
    for name in ("kiln-exec", "kiln-compile"):
        resources = container(applied, name)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 1
        assert {"cpu", "memory"} <= set(resources["requests"])


def test_grpc_probes_ask_the_health_service_on_the_port_the_server_listens_on(applied):
    for name in ("kiln-exec", "kiln-compile"):
        c = container(applied, name)
        port = int(flag(c["args"], "--port"))
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "grpc": port, "metrics": int(flag(c["args"], "--metrics-port"))}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == port, (name, probe)
            assert c[probe]["grpc"]["mode"] == "TLS" and "--tls-cert" in c["args"]
        assert "service" not in c["livenessProbe"]["grpc"], "liveness is the server's, not a model's"


def test_exec_readiness_waits_for_the_model_it_loads(applied):
    c = container(applied, "kiln-exec")
    request = json_format.Parse(flag(c["args"], "--load"), exec_pb2.LoadModelRequest())
    service = exec_pb2.DESCRIPTOR.services_by_name["ExecService"].full_name
    assert c["readinessProbe"]["grpc"]["service"] == f"{service}/{request.name}"


def test_the_signing_key_is_mounted_read_only_by_compile_and_never_by_exec(applied):
    def mounts(name):
        spec = applied[("Deployment", name)]["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        return {secrets[m["name"]]: m for m in container(applied, name)["volumeMounts"] if m["name"] in secrets}

    compile_mounts, exec_mounts = mounts("kiln-compile"), mounts("kiln-exec")
    assert compile_mounts["kiln-signing-key"]["readOnly"] is True
    assert flag(container(applied, "kiln-compile")["args"], "--signing-key").startswith(
        compile_mounts["kiln-signing-key"]["mountPath"] + "/")
    assert "kiln-signing-key" not in exec_mounts
    assert exec_mounts["kiln-keys"]["readOnly"] is True
    assert flag(container(applied, "kiln-exec")["args"], "--trusted-keys").startswith(
        exec_mounts["kiln-keys"]["mountPath"] + "/")


def test_both_services_share_the_redis_store_with_its_password_from_a_secret(applied):
    redis_port = applied[("Service", "redis")]["spec"]["ports"][0]["port"]
    for name in ("kiln-exec", "kiln-compile"):
        c = container(applied, name)
        assert flag(c["args"], "--store") == f"redis://redis:{redis_port}/0"
        (password,) = [e for e in c["env"] if e["name"] == "KILN_STORE_PASSWORD"]
        assert password["valueFrom"]["secretKeyRef"] == {"name": "kiln-redis", "key": "password"}
    assert flag(container(applied, "kiln-exec")["args"], "--compile-server") == \
        f"kiln-compile:{applied[('Service', 'kiln-compile')]['spec']['ports'][0]['port']}"
    redis = applied[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"][0]
    assert flag(redis["args"], "--maxmemory-policy") == "noeviction", "an evicted chunk would break a bundle"


def test_every_pod_runs_as_non_root_without_privilege_escalation(applied):
    for (kind, name), obj in applied.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0, name
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            assert "requests" in c["resources"], name


def test_services_select_their_pods_and_name_their_ports(applied):
    for (kind, name), service in applied.items():
        if kind != "Service":
            continue
        (workload,) = [w for (k, _), w in applied.items() if k in ("Deployment", "StatefulSet")
                       and w["metadata"]["name"] == service["spec"]["selector"]["app.kubernetes.io/name"]]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        port_names = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names, name


def test_the_kiln_cli_accepts_every_container_command(applied):
    parser = kiln_parser()
    for name in ("kiln-exec", "kiln-compile", "kiln-api"):
        args = container(applied, name)["args"]
        assert args[0] == "kiln"
        parser.parse_args(args[1:])  # an unknown flag or a malformed --load raises here


def test_the_api_gateway_balances_over_the_ready_exec_pods_with_http_probes(applied):
    c = container(applied, "kiln-api")
    port = int(flag(c["args"], "--port"))
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "http": port, "metrics": int(flag(c["args"], "--metrics-port"))}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for probe in ("startupProbe", "livenessProbe"):  # replicas down or loading: no reason to restart a gateway
        assert c[probe]["tcpSocket"] == {"port": "http"}, probe
    assert "nvidia.com/gpu" not in c["resources"]["limits"], "it scales apart from the GPUs"
    headless = applied[("Service", "kiln-exec-pods")]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == applied[("Service", "kiln-exec")]["spec"][
        "selector"]
    assert flag(c["args"], "--exec-server") == f"dns:///kiln-exec-pods.kiln.svc.cluster.local:{headless['ports'][0]['port']}"
    assert flag(c["args"], "--tls-server-name") == "kiln-exec"
    assert {e["name"] for e in c["env"]} >= {"KILN_TLS_CA"} and "KILN_CLIENT_TOKEN_FILE" not in {
        e["name"] for e in c["env"]}, "it passes its clients' tokens through and holds none"


def test_every_kiln_pod_is_scraped_on_its_metrics_port(applied):
    for name in ("kiln-exec", "kiln-compile", "kiln-api"):
        template = applied[("Deployment", name)]["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == int(flag(container(applied, name)["args"], "--metrics-port"))
