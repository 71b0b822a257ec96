"""Shared fixtures: one real compile server on loopback for the session, and the tiny model compiled once."""

import asyncio
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.client.channels import connect
from kiln.client.compile import compile_model
from kiln.client.load import load
from kiln.rpc.grpc_server import new_event_loop
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

# The compile config every test shares, so the tiny model compiles once per session.
TINY_MODEL = common_pb2.ModelSpec(preset="tiny-llama")
TINY_CONFIG = common_pb2.CompileConfig(device="cpu", compile_sizes=[8], max_compiled_tokens=128)
# A torch version no machine runs: a bundle factor that differs from this process's, whichever torch it has.
ANOTHER_TORCH = "0.0.0"


def wait_until_healthy(url: str, child: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until ``url`` (an HTTP /health of ``child``) answers {"status": "ok"}; fails with the child's log when the
    child exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                assert json.load(response) == {"status": "ok"}
            return
        except (urllib.error.URLError, ConnectionError):
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


class BackgroundServer:
    """A grpc.aio server running on its own event loop in a daemon thread: the loop the CLI's servers run on."""

    def __init__(self, start_coro_factory):
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = self.run(start_coro_factory())
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self):
        self.run(self.server.stop(grace=1))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="session")
def signing_dir(tmp_path_factory):
    """The session's bundle-signing key pair, as ``kiln keygen`` writes it: signing.key and signing.pub."""
    from kiln.store.signing import generate_key_pair

    directory = tmp_path_factory.mktemp("signing")
    generate_key_pair(directory)
    return directory


@pytest.fixture(scope="session")
def signer(signing_dir):
    from kiln.store.signing import PRIVATE_KEY_FILE, Signer

    return Signer.load(signing_dir / PRIVATE_KEY_FILE)


@pytest.fixture(scope="session")
def trusted_keys(signing_dir):
    """What the session's exec servers trust: the session signer's public key."""
    from kiln.store.signing import PUBLIC_KEY_FILE, TrustedKeys

    return TrustedKeys.load(signing_dir / PUBLIC_KEY_FILE)


@pytest.fixture(scope="session")
def compile_store(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-store")


@pytest.fixture(scope="session")
def compile_server(compile_store, signer):
    from compile_service.server import CompileServerSettings, start_compile_server

    settings = CompileServerSettings("127.0.0.1:0", compile_store, signer)
    server = BackgroundServer(lambda: start_compile_server(settings))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def compile_stub(compile_server):
    channel = connect(compile_server.address)
    yield compile_pb2_grpc.CompileServiceStub(channel)
    channel.close()


def compile_result(stub, model=TINY_MODEL, config=TINY_CONFIG) -> compile_pb2.CompileResult:
    """Run a Compile to the end and return its result."""
    return compile_model(stub, compile_pb2.CompileRequest(model=model, config=config))


@pytest.fixture(scope="session")
def tiny_compiles(compile_stub):
    """The session's first compile of the tiny model, sent twice at once: the store must compile it once."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: compile_result(compile_stub), range(2)))
    return results


@pytest.fixture(scope="session")
def tiny_key(tiny_compiles) -> str:
    return tiny_compiles[0].key.digest


@pytest.fixture(scope="session")
def otlp_receiver():
    """A real OTLP/gRPC receiver on loopback: what Jaeger would ingest, kept for the session."""
    from tracing.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


def otel_env(endpoint: str, **extra: str) -> dict:
    """This process's environment with OpenTelemetry pointed at ``endpoint``, exporting without delay."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100", **extra}


def client_tracer(endpoint: str):
    """The test's own client: a provider of its own (not the global one) exporting each span as it ends.

    Returns (provider, tracer); pass the provider to instrumented channels so their client spans use it too."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "kiln-test-client"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return provider, provider.get_tracer("tests")


@pytest.fixture(scope="session")
def traced_compile_server(otlp_receiver, tmp_path_factory, signing_dir):
    """``kiln compile-server`` as a child process with tracing to the session's receiver, and its own store."""
    from kiln_cli.service_process import ServiceProcess, free_port, kiln_command

    store, port = tmp_path_factory.mktemp("traced-store"), free_port()
    server = ServiceProcess(
        "traced compile", kiln_command("compile-server", "--host", "127.0.0.1", "--port", str(port), "--store",
                                       str(store), "--signing-key", str(signing_dir / "signing.key")),
        f"127.0.0.1:{port}", store.parent / "traced-compile.log",
        env=otel_env(otlp_receiver.endpoint, OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci"))
    server.start()
    server.wait_healthy(timeout=120)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def exec_cache(tmp_path_factory):
    """The exec server's own bundle cache (it downloads from the compile server, as a replica without a shared disk)."""
    return tmp_path_factory.mktemp("exec-cache")


@pytest.fixture(scope="session")
def step_records() -> list:
    """Every engine step of the session's exec server, as its step observers see them."""
    return []


@pytest.fixture(scope="session")
def exec_server(compile_server, tiny_key, exec_cache, step_records, trusted_keys):
    """One real exec server for the session; the tiny model is compiled (tiny_key) before it fetches anything."""
    from exec_service.server import ExecServerSettings, start_exec_server

    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address, cache_dir=exec_cache)
    server = BackgroundServer(lambda: start_exec_server(settings, step_observers=[step_records.append]))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def exec_channel(exec_server):
    channel = connect(exec_server.address)
    yield channel
    channel.close()


@pytest.fixture(scope="session")
def exec_stub(exec_channel):
    from protos import exec_pb2_grpc

    return exec_pb2_grpc.ExecServiceStub(exec_channel)


def load_model(stub, name: str, model=TINY_MODEL, **fields) -> list:
    """LoadModel to the end; returns every event, the last one ``ready``."""
    request = exec_pb2.LoadModelRequest(name=name, model=model, config=TINY_CONFIG, **fields)
    events = []
    sizing = load(stub, request, lambda phase: events.append(exec_pb2.LoadModelEvent(phase=phase)))
    return [*events, exec_pb2.LoadModelEvent(ready=sizing)]


@pytest.fixture(scope="session")
def tiny_loaded(exec_stub) -> list:
    """The session's tiny model on the exec server, dummy weights (seed 0), default sizing; its LoadModel events."""
    return load_model(exec_stub, "tiny")


@pytest.fixture(scope="module")
def gpu_stub(tmp_path_factory, signer, trusted_keys):
    """A compile and an execute service on loopback for a GPU test module: an ExecService stub."""
    from compile_service.server import CompileServerSettings, start_compile_server
    from exec_service.server import ExecServerSettings, start_exec_server

    compile_server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", tmp_path_factory.mktemp("store"), signer)))
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address,
                                  cache_dir=tmp_path_factory.mktemp("cache"))
    exec_server = BackgroundServer(lambda: start_exec_server(settings))
    channel = connect(exec_server.address)
    yield exec_pb2_grpc.ExecServiceStub(channel)
    channel.close()
    exec_server.stop()
    compile_server.stop()


# A chat template in the shape of the common ones, that refuses a chat opening with the assistant (as Llama's and
# Gemma's refuse what they cannot render).
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a chat opens with system or user') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """The tiny model as transformers saves it (the weights of seed 7), with a byte-level BPE tokenizer trained here
    by the ``tokenizers`` library to the model's 512 tokens, and CHAT_TEMPLATE in tokenizer_config.json."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kiln.model.causal_lm import transformers_model
    from kiln.model.spec import resolve

    path = tmp_path_factory.mktemp("tiny-chat")
    transformers_model(resolve(TINY_MODEL, "cpu"), "cpu", seed=7).save_pretrained(path)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)] + ["héllo wörld 😀 日本語 café"] * 5
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert bpe.get_vocab_size() == 512  # every id the model can sample has a text
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path
