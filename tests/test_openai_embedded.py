"""An execute service's own OpenAI endpoint (``kiln exec-server --openai-port``) through the official ``openai``
client: the gateway's app over the service's servicer, in its process, with no gRPC hop. Real servers on loopback:
the same answers as Generate over gRPC, the same errors and statuses as the gateway, bearer tokens checked as the
gRPC interceptor checks them, and a stream its client leaves cancelled in the engine."""

import json
import subprocess
import time
import urllib.error
import urllib.request
from typing import NamedTuple

import grpc
import pytest
from conftest import TINY_CONFIG, BackgroundServer, wait_until_healthy
from prometheus_client import CollectorRegistry
from text_model import write_text_model

from exec_service.openai.server import ApiServerSettings
from exec_service.telemetry.metrics import ExecMetrics
from kiln.rpc import keygen
from kiln.rpc.auth import TokenTable
from kiln.rpc.grpc_server import CHANNEL_OPTIONS, ServerSecurity
from kiln_cli.service_process import free_port, kiln_command
from protos import common_pb2, exec_pb2, exec_pb2_grpc

openai = pytest.importorskip("openai", exc_type=ImportError)  # the test extra's (absent on a GPU machine)

MODEL = "tiny-text"
PROMPT = "hello world, the kiln"


class Embedded(NamedTuple):
    url: str  # the OpenAI base URL, .../v1
    stub: exec_pb2_grpc.ExecServiceStub
    user: tuple  # gRPC metadata with the user token
    user_token: str
    registry: CollectorRegistry  # the service's metrics


@pytest.fixture(scope="module")
def embedded(compile_server, tiny_key, trusted_keys, tmp_path_factory):
    """An execute service with tokens and its OpenAI endpoint on a free port, the tiny text model loaded."""
    from exec_service.server import ExecServerSettings, start_exec_server

    d = tmp_path_factory.mktemp("embedded")
    table, admin, user = keygen.token_files(d)
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address, cache_dir=d / "cache",
                                  security=ServerSecurity(tokens=TokenTable.load(table)),
                                  openai=ApiServerSettings("127.0.0.1", 0, ""))
    registry = CollectorRegistry()
    server = BackgroundServer(lambda: start_exec_server(settings, metrics=ExecMetrics(registry)))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    stub = exec_pb2_grpc.ExecServiceStub(channel)
    (d / "model").mkdir()
    model = common_pb2.ModelSpec(hf_dir=str(write_text_model(d / "model")))
    events = list(stub.LoadModel(exec_pb2.LoadModelRequest(name=MODEL, model=model, config=TINY_CONFIG),
                                 metadata=(("authorization", f"Bearer {admin.read_text().strip()}"),)))
    assert events[-1].HasField("ready")
    user_token = user.read_text().strip()
    yield Embedded(f"http://127.0.0.1:{server.server.api_server.port}/v1", stub,
                   (("authorization", f"Bearer {user_token}"),), user_token, registry)
    channel.close()
    server.stop()


@pytest.fixture(scope="module")
def client(embedded):
    return openai.OpenAI(base_url=embedded.url, api_key=embedded.user_token, max_retries=0)


def test_completions_and_chat_answer_as_generate_does(client, embedded):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    (choice,) = answer.choices
    over_grpc = "".join(r.text for r in embedded.stub.Generate(
        exec_pb2.GenerateRequest(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True),
        metadata=embedded.user))
    assert choice.text == over_grpc and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 8 and answer.model == MODEL

    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == over_grpc

    several = client.completions.create(model=MODEL, prompt=[PROMPT, "the kiln"], max_tokens=4, n=2, temperature=0,
                                        extra_body={"ignore_eos": True})  # one Generate per prompt, merged
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3] and several.usage.completion_tokens == 16
    assert several.choices[0].text == several.choices[1].text == choice.text[:len(several.choices[0].text)]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
    assert [m.id for m in client.models.list().data] == [MODEL]
    answered = embedded.registry.get_sample_value("kiln:api_requests_total",
                                                  {"endpoint": "/v1/completions", "status": "200"})
    assert answered >= 2  # the gateway's HTTP metrics, on the service's own registry (--metrics-port)


def test_refusals_are_openai_errors_with_the_gateways_statuses(client, embedded):
    with pytest.raises(openai.BadRequestError) as bad:  # the field bounds the servicer checks
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert bad.value.response.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT, stream=True)
    assert missing.value.response.json()["error"]["code"] == "model_not_found"

    with pytest.raises(openai.AuthenticationError) as unknown:
        openai.OpenAI(base_url=embedded.url, api_key="not-a-token-of-this-server", max_retries=0).models.list()
    assert unknown.value.status_code == 401 and "not valid" in unknown.value.response.json()["error"]["message"]
    request = urllib.request.Request(f"{embedded.url}/completions", data=json.dumps(
        {"model": MODEL, "prompt": [5, 7], "max_tokens": 2}).encode(), headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as no_token:
        urllib.request.urlopen(request, timeout=30)
    assert no_token.value.code == 401 and "needs a bearer token" in json.load(no_token.value)["error"]["message"]


def test_a_client_that_leaves_a_stream_cancels_its_request_in_the_engine(client, embedded):
    def cancelled() -> float:
        return embedded.registry.get_sample_value("kiln:requests_total",
                                                  {"model_name": MODEL, "status": "cancelled"}) or 0.0

    before = cancelled()
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the connection closes: the app closes the servicer's stream, the engine frees its blocks
    deadline = time.monotonic() + 30
    while cancelled() == before:
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.05)
    assert cancelled() == before + 1


def test_kiln_exec_server_serves_the_openai_api_on_its_port(signing_dir, tmp_path):
    """The real command: ``--openai-port`` answers /health and /v1/models beside the gRPC port; SIGTERM stops both
    cleanly."""
    port, api_port = free_port(), free_port()
    log = (tmp_path / "exec-server.log").open("w")
    child = subprocess.Popen(kiln_command("exec-server", "--port", str(port), "--openai-port", str(api_port),
                                          "--trusted-keys", str(signing_dir / "signing.pub"),
                                          "--cache", str(tmp_path / "cache")),
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{api_port}/health", child, tmp_path / "exec-server.log", 120)
        with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/v1/models", timeout=10) as response:
            assert json.load(response) == {"object": "list", "data": []}
    finally:
        child.terminate()
        child.wait(timeout=60)
        log.close()
    assert child.returncode == 0, (tmp_path / "exec-server.log").read_text()
