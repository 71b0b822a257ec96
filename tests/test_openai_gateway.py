"""``kiln api-server`` through the official ``openai`` client: a real gateway in front of two real execute services
(round-robin) with the session's compile service behind them, a tiny model with a trained tokenizer and a chat
template, and the Prometheus metrics of every server read back with prometheus_client's parser."""

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
from typing import NamedTuple

import grpc
import pytest
from conftest import TINY_CONFIG, TINY_MODEL, BackgroundServer, compile_result, load_model, wait_until_healthy
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from text_model import write_text_model

from compile_service.metrics import CompileMetrics
from exec_service.openai.gateway_metrics import GatewayMetrics
from exec_service.openai.server import ApiServer, ApiServerSettings
from exec_service.telemetry.metrics import ExecMetrics
from kiln.rpc import keygen
from kiln.rpc.auth import TokenTable
from kiln.rpc.grpc_server import CHANNEL_OPTIONS, ServerSecurity
from kiln.rpc.tls import ClientTls, ServerTls
from kiln_cli.service_process import free_port, kiln_command
from protos import common_pb2, exec_pb2, exec_pb2_grpc
from tracing.metrics_port import serve_metrics

# From the test extra: without it, as on a GPU machine running `pytest -m gpu`, this module is skipped rather than
# failing the whole collection.
openai = pytest.importorskip("openai", exc_type=ImportError)

MODEL = "tiny-text"
PROMPT = "hello world, the kiln"


class Replica:
    """An execute service with its own metrics registry, served on a metrics port, and the tiny text model."""

    def __init__(self, settings, model_dir):
        from exec_service.server import start_exec_server

        self.registry = CollectorRegistry()
        self.server = BackgroundServer(lambda: start_exec_server(settings, metrics=ExecMetrics(self.registry)))
        self.metrics = serve_metrics(self.registry, "127.0.0.1", 0)
        self.address = f"{settings.address.rsplit(':', 1)[0]}:{self.server.port}"  # on its own host, 127.0.0.x
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = exec_pb2_grpc.ExecServiceStub(self.channel)
        if model_dir is not None:
            load_model(self.stub, MODEL, model=common_pb2.ModelSpec(hf_dir=str(model_dir)))

    def close(self):
        self.channel.close()
        self.metrics.close()
        self.server.stop()


class Gateway(NamedTuple):
    url: str
    metrics_port: int


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` at ``port``, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_text_model(tmp_path_factory.mktemp("tiny-text"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def replicas(compile_server, tiny_key, trusted_keys, tmp_path_factory, model_dir):
    from exec_service.server import ExecServerSettings

    made = [Replica(ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address,
                                       cache_dir=tmp_path_factory.mktemp(f"replica{i}")), model_dir) for i in range(2)]
    yield made
    for replica in made:
        replica.close()


@pytest.fixture(scope="module")
def gateway(replicas):
    """The gateway in this process, on a free port, balancing over both replicas."""
    target = "ipv4:" + ",".join(r.address for r in replicas)
    registry = CollectorRegistry()
    server = ApiServer(ApiServerSettings("127.0.0.1", 0, target), GatewayMetrics(registry))
    port = server.start()
    metrics = serve_metrics(registry, "127.0.0.1", 0)
    yield Gateway(f"http://127.0.0.1:{port}", metrics.port)
    metrics.close()
    server.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)


def grpc_text(stub, **fields) -> str:
    """The same request straight over gRPC: what the gateway must hand back."""
    return "".join(r.text for r in stub.Generate(exec_pb2.GenerateRequest(model=MODEL, **fields)))


def test_models_lists_the_ready_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert error_of(missing.value) == {"message": "model: no ready model named 'no-such-model'",
                                       "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_completion_text_round_trips(client, replicas, tokenizer):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.object == "text_completion" and answer.model == MODEL
    (choice,) = answer.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text == grpc_text(replicas[0].stub, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert answer.usage.completion_tokens == 8
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 8


def test_completion_from_token_ids_and_several_prompts(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    by_text = client.completions.create(model=MODEL, prompt=[PROMPT, "the quick brown fox"], max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in by_text.choices] == [0, 1]
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) + len(tokenizer.encode("the quick brown fox"))
    assert by_text.usage.completion_tokens == 8


def test_streamed_completion_is_the_whole_one_in_pieces(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *pieces, last = chunks
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_chat_completion(client, tokenizer):
    """Needs the execute service's chat messages (issue 26 item 2)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello kiln"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert answer.object == "chat.completion"
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert answer.usage.completion_tokens == 5


def test_streamed_chat_completion(client):
    """Needs the execute service's chat messages (issue 26 item 2)."""
    messages = [{"role": "user", "content": "hello kiln"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_stop_and_logprobs(client):
    """Needs n, stop strings and logprobs in the execute service (issue 26 item 2)."""
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=3,
                                       logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    for choice in answer.choices:
        assert len(choice.logprobs.token_logprobs) == 6
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert answer.usage.completion_tokens == 18

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)

    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert greedy
    stop = greedy[len(greedy) // 2:][:2]  # text from the middle: the stream may hold back a last partial character
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and greedy.startswith(stopped.text)


def error_of(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_bad_input_is_openai_error_with_its_status(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    error = error_of(bad.value)
    assert bad.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == "temperature" and set(error) == {"message", "type", "param", "code"}

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert error_of(missing.value)["code"] == "model_not_found" and error_of(missing.value)["param"] == "model"
    assert "no-such-model" in error_of(missing.value)["message"]

    with pytest.raises(openai.BadRequestError) as too_long:  # refused by the execute service: INVALID_ARGUMENT
        client.completions.create(model=MODEL, prompt=list(range(3, 300)) * 2, max_tokens=4)
    assert "max_model_len" in error_of(too_long.value)["message"]

    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"5": 1.0})
    assert error_of(unsupported.value)["param"] == "logit_bias"
    function = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    for field, value in (("tools", [{"type": "function", "function": function}]), ("functions", [function])):
        with pytest.raises(openai.BadRequestError) as unsupported:  # the chat would answer as if none were given
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           **{field: value})
        assert error_of(unsupported.value)["param"] == field

    with pytest.raises(openai.NotFoundError):  # an unknown model is refused before the stream starts
        client.completions.create(model="no-such-model", prompt=PROMPT, stream=True)


def test_a_body_that_is_not_json_or_not_an_object_is_refused_saying_where(gateway):
    """Validated from the raw bytes: the message says where the JSON broke, and names no parameter."""
    for body, message in ((b'{"model": ', "Invalid JSON: EOF while parsing a value at line 1 column 10"),
                          (b"[1, 2]", "Input should be an object")):
        request = urllib.request.Request(f"{gateway.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        error = json.load(refused.value)["error"]
        assert refused.value.code == 400 and (error["message"], error["param"]) == (message, None)


def test_an_unknown_path_and_a_wrong_method_are_openai_errors(gateway):
    """404 and 405 in OpenAI's shape (what its clients parse), saying which request was meant; 405 with Allow."""
    for method, path, status, code in (("POST", "/v1/embeddings", 404, "not_found"),
                                       ("GET", "/v1/completions", 405, "method_not_allowed")):
        request = urllib.request.Request(f"{gateway.url}{path}", method=method,
                                         data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        error = json.load(refused.value)["error"]
        assert (refused.value.code, error["code"], error["type"]) == (status, code, "invalid_request_error")
        assert error["message"].startswith(f"{method} {path}: ")
        if status == 405:
            assert refused.value.headers["Allow"] == "POST"


def test_pages_of_the_allowed_origins_may_call_from_a_browser(gateway, replicas):
    """--cors-allow-origin: a browser's preflight from an allowed origin is answered with what it may send (the
    token's header among it), a call's answer names the origin, another origin's preflight is refused; without the
    flag no answer says any origin may read it."""
    def call(url, method, origin, **headers):
        request = urllib.request.Request(url, method=method, headers={"Origin": origin, **headers})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.headers
        except urllib.error.HTTPError as refused:
            return refused.code, refused.headers

    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    target = "ipv4:" + ",".join(r.address for r in replicas)
    server = ApiServer(ApiServerSettings("127.0.0.1", 0, target, cors_origins=("https://ui.example",)))
    url = f"http://127.0.0.1:{server.start()}"
    try:
        status, headers = call(f"{url}/v1/chat/completions", "OPTIONS", "https://ui.example", **preflight)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://ui.example"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
        status, headers = call(f"{url}/v1/models", "GET", "https://ui.example")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://ui.example"
        status, headers = call(f"{url}/v1/chat/completions", "OPTIONS", "https://elsewhere.example", **preflight)
        assert status == 400 and "Access-Control-Allow-Origin" not in headers
    finally:
        server.stop()
    status, headers = call(f"{gateway.url}/v1/models", "GET", "https://ui.example")  # the flag's default: none
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_a_cors_origin_is_a_scheme_host_and_port():
    from kiln_cli.security_args import _origin

    assert [_origin(o) for o in ("*", "https://ui.example", "http://10.0.0.5:3000", "http://[::1]:8080")] == [
        "*", "https://ui.example", "http://10.0.0.5:3000", "http://[::1]:8080"]
    refused = subprocess.run(kiln_command("api-server", "--exec-server", "127.0.0.1:1", "--cors-allow-origin",
                                          "https://ui.example/"), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--cors-allow-origin: must be * or scheme://host[:port]" in refused.stderr
    refused = subprocess.run(kiln_command("exec-server", "--trusted-keys", "unread.pub", "--cors-allow-origin",
                                          "https://ui.example"), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "applies to the --openai-port endpoint" in refused.stderr


@pytest.mark.parametrize(("code", "status", "kind"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_each_grpc_status_is_the_http_status_openai_clients_act_on(code, status, kind):
    """The table itself; the statuses a real execute service sends are in the tests around this one."""
    from exec_service.openai.errors import from_rpc_error

    error = from_rpc_error(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                                details="model: 'x' is busy"))
    body = error.body()["error"]
    assert (error.status, body["type"], body["param"], body["message"]) == (status, kind, "model", "model: 'x' is busy")


def test_a_body_over_the_cap_is_refused_unread(gateway):
    """Announced (Content-Length over the default 4 MiB: refused before a byte of it is read) or chunked (refused
    once what arrived passes the cap)."""
    import http.client

    host, port = gateway.url.removeprefix("http://").split(":")
    for chunked in (False, True):
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(5 << 20))))
        connection.endheaders()
        if chunked:
            piece = b"x" * (1 << 20)
            for _ in range(5):
                connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        response = connection.getresponse()
        assert response.status == 413 and "max-request-bytes" in json.load(response)["error"]["message"]
        connection.close()


def test_no_execute_service_behind_the_gateway_is_503():
    server = ApiServer(ApiServerSettings("127.0.0.1", 0, f"127.0.0.1:{free_port()}"))  # nothing listens there
    port = server.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.value.code == 503
        with pytest.raises(openai.InternalServerError) as unavailable:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0).completions.create(
                model=MODEL, prompt=PROMPT)
        assert unavailable.value.status_code == 503
        assert error_of(unavailable.value)["code"] == "service_unavailable"
    finally:
        server.stop()


def test_two_replicas_behind_one_gateway_both_serve(client, replicas):
    before = [sum(v for (name, _), v in scrape(r.metrics.port).items() if name == "kiln:requests_total")
              for r in replicas]
    for _ in range(6):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    after = [sum(v for (name, _), v in scrape(r.metrics.port).items() if name == "kiln:requests_total")
             for r in replicas]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 6 and all(n > 0 for n in served), served


def test_a_replica_added_behind_a_dns_name_gets_calls_once_connections_age(compile_server, trusted_keys, model_dir,
                                                                           tmp_path_factory, monkeypatch):
    """The gateway's client on a DNS name (a headless Service's) that first has one replica's address: once the
    replicas' max connection age passes, the client reconnects, resolves the name again and its new calls reach a
    replica added to the name since, while a stream started before runs to its end across the age. The name is
    served by a DNS server of the test's (tests/dns_server.py), named as the target's authority, so its records
    change without touching the machine's resolver; the two replicas share a port on 127.0.0.1 and 127.0.0.2, as
    pods behind a Service do."""
    from dns_server import DnsServer

    from exec_service.openai import exec_client
    from exec_service.server import ExecServerSettings

    age_s = 0.1  # the long stream below takes about a second on a 2-core CPU host
    monkeypatch.setattr(exec_client, "DNS_REFRESH_MS", 100)  # the gateway's 10 s would only make the test slower
    port = free_port()
    dns = DnsServer({"replicas.kiln.test": ["127.0.0.1"]})
    made = [Replica(ExecServerSettings(f"{host}:{port}", trusted_keys, compile_server.address,
                                       cache_dir=tmp_path_factory.mktemp("dns-replica"), max_connection_age_s=age_s),
                    model_dir) for host in ("127.0.0.1", "127.0.0.2")]

    def served():
        return [sample(scrape(r.metrics.port), "kiln:requests_total", model_name=MODEL, status="ok") for r in made]

    async def run():
        client = exec_client.ExecClient(f"dns://127.0.0.1:{dns.port}/replicas.kiln.test:{port}")
        try:
            # As long as the model allows: its max_model_len, ended by length.
            long = exec_pb2.GenerateRequest(model=MODEL, prompt="the kiln", max_tokens=100_000, ignore_eos=True)
            started, last = time.monotonic(), None
            call = client.generate(long, None)
            async for response in call:
                last = response
                if time.monotonic() - started > 1.5 * age_s and len(dns.records["replicas.kiln.test"]) == 1:
                    dns.records["replicas.kiln.test"].append("127.0.0.2")  # a pod joins the Service
            lasted = time.monotonic() - started
            resolutions = sum(qtype == 1 for _, qtype in dns.queries)  # A queries while it ran
            deadline = time.monotonic() + 20
            while served()[1] == 0:
                assert time.monotonic() < deadline, f"no call reached the added replica: {served()}"
                short = exec_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2)
                [_ async for _ in client.generate(short, None)]
                await asyncio.sleep(0.05)
            return last, lasted, resolutions, await call.code()
        finally:
            await client.close()

    try:
        assert served() == [0, 0]
        last, lasted, resolutions, code = asyncio.run(run())
    finally:
        for replica in made:
            replica.close()
        dns.close()
    # Never cut by the age: the stream lasted past it and ran to its own end.
    assert code == grpc.StatusCode.OK and last.finish_reason == exec_pb2.FINISH_REASON_LENGTH, code
    assert lasted > 2 * age_s, f"the stream took {lasted:.2f} s: too short to cross the connection age"
    assert resolutions >= 2, dns.queries  # the client reconnected and resolved the name again while it streamed


def test_cached_tokens_are_the_prefix_cache_hits(client, replicas, tokenizer):
    """usage.prompt_tokens_details.cached_tokens is what the execute service found in its prefix cache, and the
    replicas' kiln:prefix_cache_hits_total grows by exactly that much."""
    def hits():
        return sum(sample(scrape(r.metrics.port), "kiln:prefix_cache_hits_total", model_name=MODEL) for r in replicas)

    prompt = " ".join(["the kiln serves every prompt it has seen before from its cache"] * 6)  # several blocks
    before = hits()
    cached = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details
              .cached_tokens for _ in range(3)]  # round-robin: the third lands where the first did
    assert cached[0] == 0 and cached[2] > 0 and all(c % 16 == 0 for c in cached)  # whole blocks of 16 tokens
    assert cached[2] < len(tokenizer.encode(prompt))
    assert hits() - before == sum(cached)


def test_a_client_that_leaves_a_stream_cancels_its_request(client, replicas):
    def cancelled():
        return sum(sample(scrape(r.metrics.port), "kiln:requests_total", model_name=MODEL, status="cancelled")
                   for r in replicas)

    before = cancelled()
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the connection closes: the gateway cancels the Generate, the engine frees its blocks
    deadline = time.monotonic() + 30
    while cancelled() == before:
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.1)
    assert cancelled() == before + 1


def test_metrics_count_what_was_sent(client, gateway, replicas, tokenizer):
    def totals():
        exec_samples = [scrape(r.metrics.port) for r in replicas]
        return {name: sum(sample(s, name, **labels) for s in exec_samples) for name, labels in [
            ("kiln:requests_total", {"model_name": MODEL, "status": "ok"}),
            ("kiln:request_success_total", {"model_name": MODEL, "finished_reason": "length"}),
            ("kiln:prompt_tokens_total", {"model_name": MODEL}),
            ("kiln:generation_tokens_total", {"model_name": MODEL}),
            ("kiln:time_to_first_token_seconds_count", {"model_name": MODEL}),
            ("kiln:e2e_request_latency_seconds_count", {"model_name": MODEL}),
            ("kiln:request_queue_time_seconds_count", {"model_name": MODEL}),
            ("kiln:inter_token_latency_seconds_count", {"model_name": MODEL}),
            ("kiln:inter_token_latency_seconds_sum", {"model_name": MODEL}),
        ]} | {"api": sample(scrape(gateway.metrics_port), "kiln:api_requests_total", endpoint="/v1/completions",
                             status="200"),
              "api_itl": sample(scrape(gateway.metrics_port), "kiln:api_inter_token_latency_seconds_count",
                                endpoint="/v1/completions")}

    before = totals()
    for _ in range(4):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    after = totals()
    grew = {name: after[name] - before[name] for name in after}
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert grew == {"kiln:requests_total": 4, "kiln:request_success_total": 4,
                    "kiln:prompt_tokens_total": 4 * prompt_tokens, "kiln:generation_tokens_total": 20,
                    "kiln:time_to_first_token_seconds_count": 4, "kiln:e2e_request_latency_seconds_count": 4,
                    "kiln:request_queue_time_seconds_count": 4, "kiln:inter_token_latency_seconds_count": 16,
                    "kiln:inter_token_latency_seconds_sum": grew["kiln:inter_token_latency_seconds_sum"],
                    "api": 4, "api_itl": grew["api_itl"]}
    assert grew["kiln:inter_token_latency_seconds_sum"] > 0  # every gap of every request: 4 x (5 tokens - 1)
    assert 4 <= grew["api_itl"] <= 16  # 5 tokens in 2 to 5 messages each: 1 to 4 gaps

    samples = scrape(replicas[0].metrics.port)
    assert sample(samples, "kiln:kv_blocks_free", model_name=MODEL) > 0
    assert sample(samples, "kiln:kv_blocks_used", model_name=MODEL) == 0  # nothing running now
    assert sample(samples, "kiln:num_requests_running", model_name=MODEL) == 0
    assert any(name == "kiln:forward_time_seconds_count" and dict(labels)["phase"] == "prefill"
               for name, labels in samples)


def test_compile_service_metrics(compile_store, signer, tiny_key):
    from compile_service.server import CompileServerSettings, start_compile_server

    registry = CollectorRegistry()
    settings = CompileServerSettings("127.0.0.1:0", compile_store, signer)
    server = BackgroundServer(lambda: start_compile_server(settings, CompileMetrics(registry)))
    metrics = serve_metrics(registry, "127.0.0.1", 0)
    try:
        channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
        from protos import compile_pb2_grpc

        compile_result(compile_pb2_grpc.CompileServiceStub(channel))  # the session compiled it: a hit
        channel.close()
        samples = scrape(metrics.port)
    finally:
        metrics.close()
        server.stop()
    assert sample(samples, "kiln:compiles_total", result="cache_hit") == 1
    assert sample(samples, "kiln:compile_seconds_count", result="cache_hit") == 1


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, compile_server, tiny_key, trusted_keys):
    """An execute service with TLS and tokens, the tiny preset loaded, and a gateway over TLS in front of it."""
    from exec_service.server import ExecServerSettings, start_exec_server

    d = tmp_path_factory.mktemp("gateway-tls")
    tls = keygen.tls_material(d, ["localhost", "127.0.0.1"])
    table, admin, user = keygen.token_files(d)
    security = ServerSecurity(ServerTls.load(tls.server_cert, tls.server_key), TokenTable.load(table))
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address,
                                  cache_dir=tmp_path_factory.mktemp("guarded-cache"), security=security)
    server = BackgroundServer(lambda: start_exec_server(settings))
    ca = ClientTls.load(tls.ca)
    channel = grpc.secure_channel(server.address, ca.credentials(), options=CHANNEL_OPTIONS)
    admin_token = admin.read_text().strip()
    events = list(exec_pb2_grpc.ExecServiceStub(channel).LoadModel(
        exec_pb2.LoadModelRequest(name="tiny", model=TINY_MODEL, config=TINY_CONFIG),
        metadata=(("authorization", f"Bearer {admin_token}"),)))
    assert events[-1].HasField("ready")
    gateway = ApiServer(ApiServerSettings("127.0.0.1", 0, server.address, ca))
    port = gateway.start()
    yield f"http://127.0.0.1:{port}/v1", user.read_text().strip()
    gateway.stop()
    channel.close()
    server.stop()


def test_token_passes_through_to_the_execute_service(guarded):
    url, user_token = guarded
    answer = openai.OpenAI(base_url=url, api_key=user_token, max_retries=0).completions.create(
        model="tiny", prompt=[5, 7, 9], max_tokens=3)
    assert answer.usage.completion_tokens == 3

    with pytest.raises(openai.AuthenticationError) as bad:
        openai.OpenAI(base_url=url, api_key="not-a-token-of-this-server", max_retries=0).completions.create(
            model="tiny", prompt=[5, 7, 9], max_tokens=3)
    assert bad.value.status_code == 401 and error_of(bad.value)["code"] == "invalid_api_key"

    request = urllib.request.Request(f"{url}/completions", data=json.dumps(
        {"model": "tiny", "prompt": [5, 7], "max_tokens": 2}).encode(), headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as missing:  # no Authorization header at all
        urllib.request.urlopen(request, timeout=30)
    assert missing.value.code == 401 and set(json.load(missing.value)["error"]) == {"message", "type", "param",
                                                                                     "code"}


def test_kiln_api_server_command_streams_to_curl(replicas, tmp_path):
    """The real command as a child process: /health, then ``curl -N`` on the SSE stream, then its /metrics."""
    port, metrics_port = free_port(), free_port()
    target = "ipv4:" + ",".join(r.address for r in replicas)
    log = (tmp_path / "api-server.log").open("w")
    child = subprocess.Popen(kiln_command("api-server", "--port", str(port), "--exec-server", target,
                                          "--metrics-port", str(metrics_port)), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}/health", child, tmp_path / "api-server.log", 60)
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
        out = subprocess.run(["curl", "-sS", "-N", "-X", "POST", f"http://127.0.0.1:{port}/v1/completions",
                              "-H", "Content-Type: application/json", "-d", body],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        events = [line for line in out.split("\n\n") if line]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert all(c["object"] == "text_completion" for c in chunks)
        samples = scrape(metrics_port)
        assert sample(samples, "kiln:api_requests_total", endpoint="/v1/completions", status="200") == 1
        assert sample(samples, "kiln:api_requests_total", endpoint="/health", status="200") >= 1
    finally:
        child.terminate()
        child.wait(timeout=30)
        log.close()
    assert child.returncode == 0, (tmp_path / "api-server.log").read_text()  # SIGTERM: a clean stop
