"""docker-compose.yml proven without Docker: the Compose specification's schema, the structure the README promises
(signing, TLS and tokens on; the signing key only where it signs), and each service's command run as a local
process: the one-shot key service first, then both servers, healthy and serving a Generate over TLS with a token."""

import importlib.resources
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import TINY_CONFIG, TINY_MODEL
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer

from kiln.rpc.client_security import ClientSecurity
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.rpc.tls import ClientTls
from kiln_cli.service_process import ServiceProcess, free_port
from protos import exec_pb2, exec_pb2_grpc

# From the test extra (check-jsonschema, pyyaml): without it, as on a GPU machine running `pytest -m gpu`, this
# module is skipped rather than failing the whole collection.
jsonschema = pytest.importorskip("jsonschema", exc_type=ImportError)
yaml = pytest.importorskip("yaml", exc_type=ImportError)

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "docker-compose.cpu.yml"
DOCKERFILE = ROOT / "Dockerfile"
KILN_SERVICES = ("compile", "exec")
API_SERVICE = "api"
KEYS_SERVICE = "keys"
PORT_FLAGS = ("--port", "--metrics-port")
KEYS_DIR, SIGNING_DIR = "/etc/kiln/keys", "/etc/kiln/signing"


class Reset(dict):
    """Compose's ``!reset`` tag: the key is removed when files merge (its value is what the schema sees)."""


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it, with its ``!reset`` tag."""


ComposeLoader.add_constructor(
    "!reset", lambda loader, node: Reset(loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else {}))


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), ComposeLoader)  # noqa: S506 - a SafeLoader subclass


def merge(base: dict, override: dict) -> dict:
    """Compose's merge for what our override uses: mappings merge key by key, ``!reset`` removes, the rest replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Reset):
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def cpu_compose(compose) -> dict:
    return merge(compose, load(CPU_OVERRIDE))


def compose_schema_validator() -> jsonschema.protocols.Validator:
    """The Compose specification's schema as check-jsonschema ships it (its version is pinned in pyproject)."""
    text = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    schema = json.loads(text.read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def seconds(duration: str) -> float:
    """A Compose duration such as 90s, 2m or 1m30s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration}"
    return sum(float(n) * units[u] for n, u in parts)


def volume(service: dict, target: str) -> dict:
    mounts = [v for v in service["volumes"] if v["target"] == target]
    assert len(mounts) == 1, f"one mount at {target}: {service['volumes']}"
    return mounts[0]


def published(service: dict) -> dict[int, int]:
    """Container port -> host port."""
    return {int(p.split(":")[-1]): int(p.split(":")[-2]) for p in service.get("ports", [])}


def dockerfile_env() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


# --- the schema -----------------------------------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_spec():
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                             str(COMPOSE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_override_and_merged_file_validate_against_the_compose_spec(cpu_compose):
    validator = compose_schema_validator()
    for name, document in (("docker-compose.cpu.yml", load(CPU_OVERRIDE)), ("merged", cpu_compose)):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
        assert not errors, f"{name}: {errors}"


def test_the_validator_rejects_what_compose_rejects(compose):
    """The schema is not vacuous: a misspelt key and a wrong type both fail."""
    validator = compose_schema_validator()
    broken = json.loads(json.dumps(compose))
    broken["services"]["exec"]["healthcheck"]["start_perod"] = "600s"
    broken["services"]["compile"]["deploy"]["resources"]["reservations"]["devices"] = "nvidia"
    assert len(list(validator.iter_errors(broken))) >= 2


# --- the structure ----------------------------------------------------------------------------------------------


def test_gpu_reservations_on_both_kiln_services(compose):
    for name in KILN_SERVICES:
        (device,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert device["count"] in (1, "all")


def test_cpu_override_drops_gpu_reservations_and_hides_gpus(compose, cpu_compose):
    for name in KILN_SERVICES:
        service = cpu_compose["services"][name]
        assert "deploy" not in service
        assert service["environment"]["CUDA_VISIBLE_DEVICES"] == ""
        # Everything else comes through the merge unchanged.
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == \
            compose["services"][name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert service["command"] == compose["services"][name]["command"]


def test_both_kiln_services_share_the_redis_store(compose):
    services = compose["services"]
    redis = services["redis"]
    assert re.fullmatch(r"redis:7\.\d+\.\d+", redis["image"]), "Redis 7, pinned"
    assert flag(redis["command"], "--maxmemory-policy") == "noeviction", "an evicted chunk would break a bundle"
    assert flag(redis["command"], "--appendonly") == "yes" and volume(redis, "/data")["source"] in compose["volumes"]
    assert "ports" not in redis, "only the Kiln services reach the store"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in KILN_SERVICES:
        command = services[name]["command"]
        assert flag(command, "--store") == "redis://redis:6379/0"
        assert flag(command, "--cache").startswith(volume(services[name], "/var/cache/kiln")["target"] + "/")
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compiler_caches_live_on_a_volume_per_service(compose):
    env = dockerfile_env()
    for name in KILN_SERVICES:
        caches = [v for v in compose["services"][name]["volumes"]
                  if v["target"] not in (env["KILN_STORE"], KEYS_DIR, SIGNING_DIR)]
        assert len(caches) == 1 and caches[0]["type"] == "volume" and caches[0].get("read_only", False) is False
        for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            assert env[variable].startswith(caches[0]["target"] + "/"), variable
    assert compose["services"]["compile"]["volumes"] != compose["services"]["exec"]["volumes"]


def test_otel_points_at_the_jaeger_service(compose):
    services = compose["services"]
    jaeger = services["jaeger"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"]), "Jaeger v2, pinned"
    assert {4317, 16686} <= set(published(jaeger))
    names = set()
    for name in KILN_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        names.add(env["OTEL_SERVICE_NAME"])
        assert services[name]["depends_on"]["jaeger"]["condition"] == "service_started"
    assert names == {"kiln-compile", "kiln-exec"}


def test_healthchecks_use_kiln_health_on_each_service_port(compose):
    for name in KILN_SERVICES:
        service = compose["services"][name]
        port = int(flag(service["command"], "--port"))
        check = service["healthcheck"]
        assert check["test"] == ["CMD", "kiln", "health", f"localhost:{port}"]
        assert seconds(check["timeout"]) < seconds(check["interval"])
        # A cold start can include a model's cold compile: minutes, not seconds; polled fast meanwhile.
        assert seconds(check["start_period"]) >= 300
        assert seconds(check["start_interval"]) <= 5


def test_exec_waits_for_a_healthy_compile_service(compose):
    services = compose["services"]
    assert services["exec"]["depends_on"]["compile"]["condition"] == "service_healthy"
    compile_port = flag(services["compile"]["command"], "--port")
    assert flag(services["exec"]["command"], "--compile-server") == f"compile:{compile_port}"


def test_each_service_publishes_the_port_it_listens_on(compose):
    for name in KILN_SERVICES:
        command = compose["services"][name]["command"]
        port = int(flag(command, "--port"))
        assert published(compose["services"][name]) == {port: port}
        assert flag(command, "--host") == "0.0.0.0"  # reachable from the other containers and the host


def test_dockerfile_builds_one_non_root_image_on_a_cuda_pytorch_base(compose):
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda\d+\.\d+-cudnn9-runtime$", text, re.M)
    assert base and (int(base[1]), int(base[2])) >= (2, 11), "a CUDA PyTorch base with torch>=2.11"
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    volumes = json.loads(re.search(r"^VOLUME (\[.*\])$", text, re.M)[1])
    targets = {v["target"] for name in (*KILN_SERVICES, KEYS_SERVICE) for v in compose["services"][name]["volumes"]}
    assert targets <= set(volumes)
    for name in (*KILN_SERVICES, KEYS_SERVICE):  # one image from this Dockerfile, built, never pulled
        service = compose["services"][name]
        assert (service["build"], service["image"], service["pull_policy"]) == (".", "kiln:latest", "build")


def under(path: str, mount: str) -> bool:
    return path.startswith(mount + "/")


def test_a_one_shot_service_writes_the_keys_before_either_server_starts(compose):
    services = compose["services"]
    keys = services[KEYS_SERVICE]
    command = keys["command"]
    assert command[:3] == ["kiln", "keygen", KEYS_DIR] and flag(command, "--signing-dir") == SIGNING_DIR
    assert "--tokens" in command
    hosts = flag(command, "--tls-hosts").split(",")
    assert set(KILN_SERVICES) | {"localhost"} <= set(hosts), "the certificate names every address clients dial"
    assert keys["restart"] == "no" and "ports" not in keys and "healthcheck" not in keys
    assert {v["target"]: v["read_only"] for v in keys["volumes"]} == {KEYS_DIR: False, SIGNING_DIR: False}
    for name in KILN_SERVICES:
        assert services[name]["depends_on"][KEYS_SERVICE]["condition"] == "service_completed_successfully"


def test_the_signing_key_is_mounted_where_it_signs_and_nowhere_else(compose):
    services = compose["services"]
    signing_volume = volume(services[KEYS_SERVICE], SIGNING_DIR)["source"]
    keys_volume = volume(services[KEYS_SERVICE], KEYS_DIR)["source"]
    assert {signing_volume, keys_volume} <= set(compose["volumes"])
    compile_signing = volume(services["compile"], SIGNING_DIR)
    assert compile_signing["source"] == signing_volume and compile_signing["read_only"] is True
    assert all(v["source"] != signing_volume for v in services["exec"]["volumes"]), "exec could sign bundles"
    for name in KILN_SERVICES:
        mount = volume(services[name], KEYS_DIR)
        assert mount["source"] == keys_volume and mount["read_only"] is True
    assert under(flag(services["compile"]["command"], "--signing-key"), SIGNING_DIR)
    assert flag(services["exec"]["command"], "--trusted-keys") == f"{KEYS_DIR}/signing.pub"


def test_both_servers_run_with_tls_and_tokens_and_their_clients_have_the_ca_and_a_token(compose):
    for name in KILN_SERVICES:
        service = compose["services"][name]
        command = service["command"]
        for option in ("--tls-cert", "--tls-key", "--auth-token-file"):
            assert under(flag(command, option), KEYS_DIR), (name, option)
        assert flag(command, "--host") == "0.0.0.0"  # said explicitly, on compose's private network
        env = service["environment"]
        assert under(env["KILN_TLS_CA"], KEYS_DIR) and under(env["KILN_CLIENT_TOKEN_FILE"], KEYS_DIR)


def test_the_api_gateway_balances_over_exec_with_tls_and_the_clients_tokens(compose):
    services = compose["services"]
    api = services[API_SERVICE]
    command = api["command"]
    assert command[:2] == ["kiln", "api-server"] and flag(command, "--host") == "0.0.0.0"
    exec_port = flag(services["exec"]["command"], "--port")
    assert flag(command, "--exec-server") == f"dns:///exec:{exec_port}", "every replica behind the name"
    assert flag(command, "--tls-server-name") in flag(services[KEYS_SERVICE]["command"], "--tls-hosts").split(",")
    assert under(api["environment"]["KILN_TLS_CA"], KEYS_DIR)
    assert "KILN_CLIENT_TOKEN_FILE" not in api["environment"], "the gateway passes its clients' tokens through"
    assert volume(api, KEYS_DIR)["read_only"] is True and len(api["volumes"]) == 1
    assert "deploy" not in api, "no GPU: it scales apart from them"
    port = int(flag(command, "--port"))
    assert published(api) == {port: port}
    assert f"http://localhost:{port}/health" in api["healthcheck"]["test"][-1]
    assert api["depends_on"]["exec"]["condition"] == "service_healthy"


def test_every_kiln_server_serves_metrics_on_a_port_of_its_own_unpublished(compose):
    ports = []
    for name in (*KILN_SERVICES, API_SERVICE):
        service = compose["services"][name]
        port = int(flag(service["command"], "--metrics-port"))
        assert port not in published(service) and port != int(flag(service["command"], "--port"))
        ports.append(port)
    assert len(set(ports)) == len(ports)


# --- the services, run as local processes ------------------------------------------------------------------------


def read_only_bind(paths: list[Path]) -> list[str] | None:
    """A command prefix that runs its command with ``paths`` mounted read-only, as compose's ``:ro`` does, while
    other processes keep writing there; None where mount namespaces are not allowed."""
    mounts = " && ".join(f"mount --bind {p} {p} && mount -o remount,ro,bind {p}" for p in paths)
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        try:
            probe = subprocess.run([*prefix, "sh", "-c", f'{mounts} && ! touch {paths[0]}/.probe 2>/dev/null'],
                                   capture_output=True, timeout=30)
        except FileNotFoundError:
            return None
        if probe.returncode == 0:
            return [*prefix, "sh", "-c", f'{mounts} && exec "$@"', "sh"]
    return None


class LocalCompose:
    """Compose's names made local: service hosts and jaeger to 127.0.0.1, each container port to a free port,
    each volume to a directory under ``root``."""

    def __init__(self, compose: dict, root: Path, otlp_port: int):
        self.compose = compose
        container_ports = {port for s in compose["services"].values() for port in published(s)}
        container_ports |= {int(flag(s["command"], f)) for s in compose["services"].values()
                            for f in PORT_FLAGS if f in s.get("command", [])}
        self.ports = {port: free_port() for port in container_ports}
        self.ports[4317] = otlp_port
        self.volumes = {v["target"]: root / v["source"] for s in compose["services"].values()
                        for v in s.get("volumes", [])}
        for path in self.volumes.values():
            path.mkdir(parents=True, exist_ok=True)

    def value(self, text: str) -> str:
        hosts = "|".join(map(re.escape, [*self.compose["services"], "localhost"]))
        text = re.sub(rf"\b(?:{hosts}):(\d+)\b", lambda m: f"127.0.0.1:{self.ports[int(m[1])]}", text)
        for target, path in self.volumes.items():
            if text == target or text.startswith(target + "/"):
                text = str(path) + text[len(target):]
        return "127.0.0.1" if text == "0.0.0.0" else text

    def argv(self, argv: list[str]) -> list[str]:
        previous = ["", *argv[:-1]]
        return [str(self.ports[int(a)]) if p in PORT_FLAGS else self.value(a)
                for p, a in zip(previous, argv, strict=True)]

    def env(self, service: str) -> dict:
        """The service's compose environment over ours, without any OTEL_* of ours, with the venv's kiln on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update({k: self.value(str(v))
                    for k, v in self.compose["services"][service].get("environment", {}).items()})
        return env

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[int(flag(self.compose['services'][service]['command'], '--port'))]}"

    def wait_healthy(self, service: str, process: ServiceProcess) -> float:
        """Run the service's own healthcheck command until it exits 0, within its start_period."""
        check = self.compose["services"][service]["healthcheck"]
        assert check["test"][0] == "CMD"
        argv = self.argv(check["test"][1:])
        started = time.monotonic()
        while time.monotonic() - started < seconds(check["start_period"]):
            assert process.process.poll() is None, f"{service} exited\n{process.log_tail()}"
            result = subprocess.run(argv, env=self.env(service), capture_output=True, text=True,
                                    timeout=seconds(check["timeout"]) + 30)
            if result.returncode == 0:
                return time.monotonic() - started
            time.sleep(1)
        raise AssertionError(f"{service}: {argv} never exited 0: {result.stderr}\n{process.log_tail()}")

    def wait_http_healthy(self, service: str, process: subprocess.Popen, log: Path) -> None:
        """As wait_healthy, for a service whose healthcheck is an HTTP request made by ``python -c``."""
        check = self.compose["services"][service]["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"]
        argv = [sys.executable, "-c", self.value(check["test"][3])]
        started = time.monotonic()
        while time.monotonic() - started < seconds(check["start_period"]):
            assert process.poll() is None, f"{service} exited\n{log.read_text()}"
            if subprocess.run(argv, capture_output=True, timeout=seconds(check["timeout"]) + 30).returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"{service}: its healthcheck never passed\n{log.read_text()}")


@pytest.fixture(scope="module")
def otlp():
    from tracing.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


def test_compose_commands_run_locally_become_healthy_and_serve_generate(cpu_compose, tmp_path, otlp):
    local = LocalCompose(cpu_compose, tmp_path, otlp.port)
    if read_only_bind([tmp_path]) is None:  # run writable, it would not show what compose's :ro mounts show
        pytest.skip("no mount namespace here: the services cannot get their volumes read-only, as compose mounts them")
    keys = subprocess.run(local.argv(cpu_compose["services"][KEYS_SERVICE]["command"]), capture_output=True,
                          text=True, timeout=120, env=local.env(KEYS_SERVICE))
    assert keys.returncode == 0, keys.stderr
    redis = RedisServer(tmp_path / "redis").start()  # the compose `redis` service, on a free port
    local.ports[6379] = redis.port
    services = {}
    try:
        for name in ("compile", "exec"):  # exec depends_on a healthy compile
            argv = local.argv(cpu_compose["services"][name]["command"])
            read_only_mounts = [local.volumes[v["target"]] for v in cpu_compose["services"][name]["volumes"]
                                if v.get("read_only")]
            if read_only_mounts:
                argv = read_only_bind(read_only_mounts) + argv
            services[name] = ServiceProcess(name, argv, local.address(name), tmp_path / f"{name}.log",
                                            local.env(name))
            services[name].start()
            local.wait_healthy(name, services[name])

        key_dir = local.volumes[KEYS_DIR]
        tls = ClientTls.load(key_dir / "ca.pem")
        with ClientSecurity(tls).channel(local.address("exec"), CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.RpcError) as exc:  # TLS alone is not enough: LoadModel needs an admin token
                list(exec_pb2_grpc.ExecServiceStub(channel).LoadModel(exec_pb2.LoadModelRequest(model=TINY_MODEL)))
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        admin = (key_dir / "admin.token").read_text().strip()
        with ClientSecurity(tls, admin).channel(local.address("exec"), CHANNEL_OPTIONS) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            events = list(stub.LoadModel(exec_pb2.LoadModelRequest(model=TINY_MODEL, config=TINY_CONFIG)))
            assert events[-1].HasField("ready"), events
            fetch = next(e.phase for e in events if e.HasField("phase") and e.phase.phase == "fetch"
                         and not e.phase.progress)
            assert f"shared store redis://127.0.0.1:{redis.port}/0" in fetch.detail, "exec reads the shared store"
            responses = list(stub.Generate(exec_pb2.GenerateRequest(
                model="tiny-llama", prompt_ids=[5, 6, 7, 8], max_tokens=8, temperature=0.0, ignore_eos=True)))
        assert sum(len(r.token_ids) for r in responses) == 8
        assert responses[-1].finish_reason == exec_pb2.FINISH_REASON_LENGTH
        model_health = subprocess.run(
            local.argv(["kiln", "health", "localhost:50052", "--service", "kiln.v1.ExecService/tiny-llama"]),
            env=local.env("exec"), capture_output=True, text=True, timeout=60)
        assert model_health.returncode == 0, model_health.stderr

        # The compile service traced to "jaeger" under its compose OTEL_SERVICE_NAME.
        otlp.wait_for(lambda r: [s for s in r.spans() if s.resource.get("service.name") == "kiln-compile"
                                 and s.name == "compile"])

        # The gateway in front of exec: its HTTP healthcheck, then a completion with a user token passed through.
        argv = local.argv(cpu_compose["services"][API_SERVICE]["command"])
        with (tmp_path / "api.log").open("w") as log:
            services[API_SERVICE] = api = subprocess.Popen(argv, env=local.env(API_SERVICE), stdout=log,
                                                           stderr=subprocess.STDOUT)
        local.wait_http_healthy(API_SERVICE, api, tmp_path / "api.log")
        url = f"http://127.0.0.1:{flag(argv, '--port')}/v1/completions"
        body = json.dumps({"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 4}).encode()
        user = (key_dir / "user.token").read_text().strip()
        with urllib.request.urlopen(urllib.request.Request(url, body, {
                "Content-Type": "application/json", "Authorization": f"Bearer {user}"}), timeout=60) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 4
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=60)
        assert refused.value.code == 401
        api.terminate()
        assert api.wait(timeout=60) == 0

        # Every server's --metrics-port, as Prometheus would scrape it on compose's network.
        def scrape(service: str) -> dict:
            port = local.ports[int(flag(cpu_compose["services"][service]["command"], "--metrics-port"))]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                return {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in text_string_to_metric_families(response.read().decode()) for s in f.samples}

        ok = (("model_name", "tiny-llama"), ("status", "ok"))
        assert scrape("exec")[("kiln:requests_total", ok)] == 2  # the Generate and the completion
        assert scrape("compile")[("kiln:compiles_total", (("result", "compiled"),))] == 1
        for name in ("exec", "compile"):
            assert services[name].stop() == 0
    finally:
        for service in services.values():
            service.kill()
            if isinstance(service, subprocess.Popen):
                service.wait(timeout=30)
        redis.stop()
