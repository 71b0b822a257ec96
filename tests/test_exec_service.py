"""The execute service through its real gRPC server, fetching real bundles from the real compile server.

Greedy output is checked token for token against transformers' own ``generate`` on the same weights.
"""

import asyncio
import json
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from conftest import ANOTHER_TORCH, TINY_MODEL, BackgroundServer, load_model
from grpc_health.v1 import health_pb2, health_pb2_grpc

from exec_service.server import ExecServerSettings, start_exec_server
from kiln.compilation.counters import compile_counts
from kiln.errors import InvalidArgument
from kiln.model.spec import resolve
from kiln.runtime_mode import RuntimeMode
from kiln.store import bundle
from kiln.store.artifact_store import FilesystemStore
from protos import common_pb2, exec_pb2, exec_pb2_grpc

PHASES = ["fetch", "load_weights", "profile_memory", "load_compiled", "capture_cudagraphs", "ready"]
# Prompt lengths around the block size (16) and past the step budget (128: the longest prefills in chunks).
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 150]


def hf_model(seed: int = 0):
    """transformers' own model with the weights build_model gives for ``seed``, on its SDPA attention."""
    from kiln.model.causal_lm import transformers_model

    model = transformers_model(resolve(TINY_MODEL, "cpu"), "cpu", seed=seed)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture(scope="module")
def hf_tiny():
    return hf_model(0)


def test_kiln_model_stays_transformers_own_outside_a_kiln_forward(hf_tiny):
    """Kiln routes each decoder layer to its compiled code only inside its own forward: transformers' generate on
    the same modules (its cache, its masks) gives transformers' tokens, as the reference runs of the GPU tests and
    the benches use it."""
    from kiln.model.causal_lm import build_model

    causal_lm = build_model(resolve(TINY_MODEL, "cpu"), "cpu", seed=0).causal_lm
    causal_lm.config._attn_implementation = "sdpa"
    prompt = list(range(3, 40))
    assert hf_greedy(causal_lm, prompt, 12) == hf_greedy(hf_tiny, prompt, 12)


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt + 3) % 509 + 3 for i in range(length)]


def generate(stub, model: str, prompt: list[int], **fields) -> tuple[list[int], exec_pb2.GenerateResponse]:
    """All tokens of one Generate, and its last message."""
    tokens, last = [], None
    for response in stub.Generate(exec_pb2.GenerateRequest(model=model, prompt_ids=prompt, **fields)):
        tokens += response.token_ids
        last = response
    return tokens, last


def greedy_concurrently(stub, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(stub, model, p, max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True), prompts))


def model_info(stub, name: str) -> exec_pb2.ModelInfo:
    return next(m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models if m.name == name)


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_startup_phases_in_order_profile_before_compiled_load(tiny_loaded, tiny_key):
    phases = [e.phase for e in tiny_loaded if e.HasField("phase") and not e.phase.progress]
    assert [p.phase for p in phases] == PHASES
    by_name = {p.phase: p for p in phases}
    # Downloaded from the compile service, or found in the exec server's own cache when an earlier test of the
    # session loaded the same bundle (any step budget over one compiled range is one bundle).
    assert by_name["fetch"].detail.startswith(("downloaded", "local cache")) and tiny_key in by_name["fetch"].detail
    sizing = tiny_loaded[-1].ready
    assert by_name["profile_memory"].detail == f"# CPU blocks: {sizing.num_kv_blocks}"
    assert sizing.key.digest == tiny_key and sizing.runtime_mode == "compiled" and sizing.device == "cpu"
    assert sizing.dtype == "float32"  # no dtype asked: the CPU's default
    assert sizing.num_kv_blocks == (64 << 20) // (2 * 2 * 16 * 2 * 16 * 4)  # 64 MiB of 8 KiB blocks
    assert sizing.max_num_batched_tokens == 128 and sizing.max_model_len == 512 and sizing.vocab_size == 512
    assert [t.phase for t in sizing.timings] == PHASES[:-1]


def test_ready_names_the_dtype_asked_for(exec_stub):
    """A dtype other than the device's default is served and named in the ready reply; its KV blocks take half
    the bytes of float32's."""
    spec = common_pb2.ModelSpec(preset="tiny-llama", dtype="bfloat16")
    sizing = load_model(exec_stub, "tiny-bf16", model=spec, runtime_mode=exec_pb2.RUNTIME_MODE_EAGER)[-1].ready
    try:
        assert sizing.dtype == "bfloat16"
        assert sizing.kv_cache_bytes == sizing.num_kv_blocks * 2 * 2 * 16 * 2 * 16 * 2  # 2-byte elements
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-bf16"))


def test_greedy_matches_transformers_for_concurrent_prompts(exec_stub, tiny_loaded, hf_tiny, step_records):
    prompts = [prompt_of(n, salt) for salt, n in enumerate(PROMPT_LENGTHS)]
    first_step = len(step_records)
    results = greedy_concurrently(exec_stub, "tiny", prompts, max_tokens=24)
    for prompt, (tokens, last) in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(hf_tiny, prompt, 24), f"prompt of {len(prompt)} tokens"
        assert last.finish_reason == exec_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(prompt) and last.usage.output_tokens == 24
    steps = [r for r in step_records[first_step:] if r.model == "tiny"]
    assert max(r.batch_size for r in steps) > 1
    assert "mixed" in {r.phase for r in steps}, "some step should decode while another prompt prefills"
    assert max(r.num_tokens for r in steps) <= 128
    assert all(r.runtime_mode == "compiled" and r.end_ns >= r.start_ns for r in steps)


def test_preemption_keeps_greedy_output_exact(exec_stub, hf_tiny):
    # 12 blocks of 16 tokens: each request fits alone (at most 6 blocks), all four at once do not.
    events = load_model(exec_stub, "tiny-small-kv", kv_cache_bytes=12 * 8192)
    assert events[-1].ready.num_kv_blocks == 12
    prompts = [prompt_of(n, salt) for salt, n in enumerate([20, 33, 47, 60])]
    results = greedy_concurrently(exec_stub, "tiny-small-kv", prompts, max_tokens=30)
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(hf_tiny, prompt, 30)
    assert sum(last.usage.num_preemptions for _, last in results) > 0
    assert model_info(exec_stub, "tiny-small-kv").num_free_blocks == 12

    with pytest.raises(grpc.RpcError) as exc:
        generate(exec_stub, "tiny-small-kv", prompt_of(150), max_tokens=100)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "249 tokens need 16 KV blocks" in exc.value.details() and "has 12" in exc.value.details()


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """A tiny model saved by transformers with other weights than the dummy ones, and a word-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-hf")
    hf_model(seed=7).save_pretrained(path)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 512)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def test_weights_from_a_local_hf_directory(exec_stub, weights_dir):
    from transformers import AutoModelForCausalLM

    load_model(exec_stub, "tiny-hf", weights=str(weights_dir))
    reference = AutoModelForCausalLM.from_pretrained(weights_dir, attn_implementation="sdpa").eval()
    prompts = [prompt_of(n, salt) for salt, n in enumerate([3, 19, 70])]
    for prompt, (tokens, _) in zip(prompts, greedy_concurrently(exec_stub, "tiny-hf", prompts, 16), strict=True):
        assert tokens == hf_greedy(reference, prompt, 16)

    # The directory has a tokenizer, so text goes in and comes out.
    texts, tokens = [], []
    request = exec_pb2.GenerateRequest(model="tiny-hf", prompt="w5 w7 w100", max_tokens=6, temperature=0,
                                       ignore_eos=True)
    for response in exec_stub.Generate(request):
        texts.append(response.text)
        tokens += response.token_ids
    assert tokens == hf_greedy(reference, [5, 7, 100], 6)
    assert "".join(texts) == " ".join(f"w{t}" for t in tokens)


def test_second_load_uses_the_local_cache_and_nothing_compiles_after_fetch(exec_stub, tiny_loaded, hf_tiny):
    before = compile_counts()
    events = load_model(exec_stub, "tiny-counted")
    fetch = next(e.phase for e in events if e.HasField("phase") and e.phase.phase == "fetch" and not e.phase.progress)
    assert fetch.detail.startswith("local cache"), "a second load must not download again"
    prompts = [prompt_of(n, salt) for salt, n in enumerate([2, 30, 130])]
    for prompt, (tokens, _) in zip(prompts, greedy_concurrently(exec_stub, "tiny-counted", prompts, 8), strict=True):
        assert tokens == hf_greedy(hf_tiny, prompt, 8)
    delta = compile_counts() - before
    assert (delta.dynamo_graphs, delta.inductor_compiles) == (0, 0)


def test_eager_mode_fetches_nothing_and_matches(exec_stub, hf_tiny):
    events = load_model(exec_stub, "tiny-eager", runtime_mode=exec_pb2.RUNTIME_MODE_EAGER)
    assert events[-1].ready.runtime_mode == "eager" and not events[-1].ready.key.digest
    prompt = prompt_of(9)
    assert generate(exec_stub, "tiny-eager", prompt, max_tokens=8, temperature=0, ignore_eos=True)[0] == \
        hf_greedy(hf_tiny, prompt, 8)


def test_stop_tokens_and_max_model_len_end_generation(exec_stub, tiny_loaded, hf_tiny):
    prompt = prompt_of(12)
    expected = hf_greedy(hf_tiny, prompt, 10)
    stop = expected[4]
    tokens, last = generate(exec_stub, "tiny", prompt, max_tokens=10, temperature=0, stop_token_ids=[stop])
    assert tokens == expected[:expected.index(stop) + 1]
    assert last.finish_reason == exec_pb2.FINISH_REASON_STOP

    tokens, last = generate(exec_stub, "tiny", prompt_of(505), max_tokens=50, temperature=0, ignore_eos=True)
    assert len(tokens) == 512 - 505 and last.finish_reason == exec_pb2.FINISH_REASON_LENGTH


def test_cancellation_and_deadline_free_blocks(exec_stub, tiny_loaded):
    start = model_info(exec_stub, "tiny").num_free_blocks
    call = exec_stub.Generate(exec_pb2.GenerateRequest(model="tiny", prompt_ids=prompt_of(100), max_tokens=2000,
                                                       ignore_eos=True))
    next(call)
    info = model_info(exec_stub, "tiny")
    assert info.num_running == 1 and info.num_free_blocks < start
    call.cancel()
    wait_until(lambda: model_info(exec_stub, "tiny").num_free_blocks == start)

    # 211 tokens to max_model_len 512: a few hundred ms of steps even on a fast idle host, well past the deadline.
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.Generate(exec_pb2.GenerateRequest(model="tiny", prompt_ids=prompt_of(300), max_tokens=2000,
                                                         ignore_eos=True), timeout=0.1))
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: model_info(exec_stub, "tiny").num_free_blocks == start)
    assert model_info(exec_stub, "tiny").num_running == 0


def test_seeded_sampling_is_reproducible(exec_stub, tiny_loaded):
    def sample(seed, prompt):
        return generate(exec_stub, "tiny", prompt, max_tokens=12, temperature=0.9, top_p=0.95, top_k=100,
                        seed=seed, ignore_eos=True)[0]

    prompt = prompt_of(10)
    alone = sample(1234, prompt)
    # Again, now sharing every step with other requests: a seeded request's tokens must not depend on them.
    with ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(generate, exec_stub, "tiny", prompt_of(30, s), max_tokens=12, temperature=1.0,
                             ignore_eos=True) for s in range(3)]
        together = sample(1234, prompt)
        [f.result() for f in crowd]
    assert together == alone
    assert sample(4321, prompt) != alone


def test_bad_inputs_get_their_status_while_another_request_streams(exec_stub, tiny_loaded, hf_tiny):
    prompt = prompt_of(20)
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(generate, exec_stub, "tiny", prompt, max_tokens=150, temperature=0, ignore_eos=True)
        wait_until(lambda: model_info(exec_stub, "tiny").num_running >= 1)
        cases = [
            (dict(model="nope", prompt_ids=[1]), grpc.StatusCode.NOT_FOUND, "model"),
            (dict(prompt_ids=prompt_of(512)), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: 512 tokens"),
            (dict(prompt_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: the prompt is empty"),
            (dict(prompt_ids=[1, 512]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids[1]: token id 512"),
            (dict(prompt_ids=[1, -3]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids[1]"),
            (dict(prompt_ids=[1], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
            (dict(prompt_ids=[1], max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
            (dict(prompt_ids=[1], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
            (dict(prompt_ids=[1], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
            (dict(prompt_ids=[1], temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
            (dict(prompt_ids=[1], top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
            (dict(prompt_ids=[1], stop_token_ids=[600]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids[0]"),
            (dict(prompt="hello"), grpc.StatusCode.INVALID_ARGUMENT, "prompt: model 'tiny' has no tokenizer"),
            (dict(prompt="w1", prompt_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
        ]
        for fields, code, text in cases:
            request = exec_pb2.GenerateRequest(**{"model": "tiny", **fields})
            with pytest.raises(grpc.RpcError) as exc:
                list(exec_stub.Generate(request))
            assert exc.value.code() == code, fields
            assert text in exc.value.details(), (fields, exc.value.details())
        assert not streaming.done(), "the good request should still be streaming"
        tokens, _ = streaming.result()
    assert tokens == hf_greedy(hf_tiny, prompt, 150)


def test_generate_before_ready_is_unavailable(exec_stub, exec_channel, exec_cache, tiny_key, tiny_loaded):
    health = health_pb2_grpc.HealthStub(exec_channel)

    def status(name):
        return health.Check(health_pb2.HealthCheckRequest(service=f"kiln.v1.ExecService/{name}")).status

    # Another loader holding the cache's lock on the bundle keeps this load in its fetch phase.
    with ThreadPoolExecutor(1) as pool:
        with FilesystemStore(exec_cache).lock(tiny_key):
            loading = pool.submit(load_model, exec_stub, "tiny-late")
            wait_until(lambda: any(m.name == "tiny-late" for m in exec_stub.ListModels(
                exec_pb2.ListModelsRequest()).models))
            assert model_info(exec_stub, "tiny-late").state == exec_pb2.MODEL_STATE_LOADING
            assert status("tiny-late") == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as exc:
                generate(exec_stub, "tiny-late", [1, 2])
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in exc.value.details()
        loading.result()
    assert status("tiny-late") == health_pb2.HealthCheckResponse.SERVING
    assert status("tiny") == health_pb2.HealthCheckResponse.SERVING
    assert len(generate(exec_stub, "tiny-late", [1, 2], max_tokens=3)[0]) >= 1


def test_full_waiting_queue_is_resource_exhausted(exec_stub):
    load_model(exec_stub, "tiny-queue", max_num_seqs=1, max_num_waiting=1)
    long = dict(model="tiny-queue", prompt_ids=[1, 2, 3], max_tokens=2000, ignore_eos=True)
    running = exec_stub.Generate(exec_pb2.GenerateRequest(**long))
    next(running)
    waiting = exec_stub.Generate(exec_pb2.GenerateRequest(**long))
    wait_until(lambda: model_info(exec_stub, "tiny-queue").num_waiting == 1)
    with pytest.raises(grpc.RpcError) as exc:
        generate(exec_stub, "tiny-queue", [1, 2, 3])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_num_waiting" in exc.value.details()
    running.cancel()
    next(waiting)  # the waiting request moves up once the running one is gone
    waiting.cancel()


def test_a_stream_interval_sends_the_first_token_alone_then_n_at_a_time(exec_stub, tiny_loaded):
    """stream_interval 3: 8 tokens come as messages of 1, 3, 3 and 1 (the first at once, the last with what has
    gathered), the same tokens the default interval streams one per message; ModelSizing says what was chosen, and an
    interval past its bound is refused naming the field."""
    ready = load_model(exec_stub, "tiny-interval", stream_interval=3)[-1].ready
    assert ready.stream_interval == 3 and tiny_loaded[-1].ready.stream_interval == 1
    fields = dict(prompt_ids=prompt_of(5), max_tokens=8, temperature=0.0, ignore_eos=True)
    paced = list(exec_stub.Generate(exec_pb2.GenerateRequest(model="tiny-interval", **fields)))
    each = list(exec_stub.Generate(exec_pb2.GenerateRequest(model="tiny", **fields)))
    assert [len(m.token_ids) for m in paced] == [1, 3, 3, 1]
    assert [len(m.token_ids) for m in each] == [1] * 8
    assert [t for m in paced for t in m.token_ids] == [t for m in each for t in m.token_ids]
    assert paced[-1].finish_reason == each[-1].finish_reason and paced[-1].usage.output_tokens == 8
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-interval"))
    with pytest.raises(grpc.RpcError) as exc:
        load_model(exec_stub, "tiny-interval", stream_interval=257)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_interval" in exc.value.details()


def test_a_burst_of_calls_is_answered_by_the_service_not_cancelled_by_grpcs_backlog(exec_server, exec_stub):
    """2,000 Generate calls at once on one connection, as a rate-inf benchmark sends them: more than gRPC's default
    backlog of calls the event loop has not taken yet (1,000, then dropped at random up to 3,000, each a bare
    CANCELLED). Every call gets the service's own answer: its tokens, or RESOURCE_EXHAUSTED naming max_num_waiting."""
    load_model(exec_stub, "tiny-burst", max_num_seqs=4, max_num_waiting=8)

    async def burst() -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(exec_server.address) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)

            async def one() -> tuple[grpc.StatusCode, str]:
                try:
                    async for _ in stub.Generate(exec_pb2.GenerateRequest(model="tiny-burst", prompt_ids=[1, 2, 3],
                                                                          max_tokens=1)):
                        pass
                    return grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()

            return await asyncio.gather(*(one() for _ in range(2000)))

    answers = asyncio.run(burst())
    codes = Counter(code for code, _ in answers)
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert all("max_num_waiting" in details for code, details in answers if code != grpc.StatusCode.OK)


def test_bundle_for_another_torch_is_failed_precondition(exec_stub, compile_store, tiny_key, signer):
    """A bundle a trusted compile service signed on another torch: the signature holds, the environment does not."""
    forged = "f" * 64
    shutil.copytree(compile_store / tiny_key, compile_store / forged)
    factors = json.loads((compile_store / forged / bundle.KEY_FACTORS).read_text())
    factors["environment"]["torch"] = ANOTHER_TORCH
    (compile_store / forged / bundle.KEY_FACTORS).write_text(json.dumps(factors))
    manifest = bundle.read_manifest(compile_store / forged)
    fields = {k: v for k, v in manifest.__dict__.items() if k not in ("files", "key")}
    bundle.write_manifest(compile_store / forged, key=forged, **fields)
    bundle.sign(compile_store / forged, signer)

    with pytest.raises(grpc.RpcError) as exc:
        load_model(exec_stub, "tiny-old-torch", key=common_pb2.ArtifactKey(digest=forged))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"was compiled for environment.torch {ANOTHER_TORCH}, this process has {torch.__version__}" in \
        exc.value.details()
    info = model_info(exec_stub, "tiny-old-torch")
    assert info.state == exec_pb2.MODEL_STATE_FAILED and f"torch {ANOTHER_TORCH}" in info.error
    with pytest.raises(grpc.RpcError) as exc:
        generate(exec_stub, "tiny-old-torch", [1])
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "failed to load" in exc.value.details()


def test_bad_load_requests(exec_stub, tiny_key, tiny_loaded):
    def load_error(**fields) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as exc:
            load_model(exec_stub, fields.pop("name", "tiny-bad"), **fields)
        return exc.value

    key = common_pb2.ArtifactKey(digest=tiny_key)
    cases = [
        (dict(max_model_len=513), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
        (dict(block_size=12), grpc.StatusCode.INVALID_ARGUMENT, "block_size"),
        (dict(gpu_memory_utilization=1.5), grpc.StatusCode.INVALID_ARGUMENT, "gpu_memory_utilization"),
        (dict(runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH), grpc.StatusCode.INVALID_ARGUMENT, "runtime_mode"),
        (dict(capture_sizes=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "capture_sizes"),
        (dict(kv_cache_bytes=100), grpc.StatusCode.RESOURCE_EXHAUSTED, "kv_cache_bytes"),
        (dict(max_num_batched_tokens=256), grpc.StatusCode.INVALID_ARGUMENT, "max_num_batched_tokens: 256"),
        (dict(name="no spaces"), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (dict(name="tiny"), grpc.StatusCode.ALREADY_EXISTS, "name"),
        (dict(weights="/nonexistent"), grpc.StatusCode.NOT_FOUND, "weights"),
        (dict(key=common_pb2.ArtifactKey(digest="xyz")), grpc.StatusCode.INVALID_ARGUMENT, "key.digest"),
        (dict(key=common_pb2.ArtifactKey(digest="0" * 64)), grpc.StatusCode.NOT_FOUND, "no artifact"),
    ]
    for fields, code, text in cases:
        error = load_error(**fields)
        assert error.code() == code, (fields, error.details())
        assert text in error.details(), (fields, error.details())

    # A key must belong to the model it is loaded for.
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.LoadModel(exec_pb2.LoadModelRequest(
            name="qwen-with-llama-bundle", model=common_pb2.ModelSpec(preset="qwen2.5-0.5b", dtype="float32"),
            key=key)))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "model_config.hidden_size 64, the request asks for 896" in exc.value.details()


def test_bad_piecewise_capture_sizes_are_refused_naming_the_field(exec_stub):
    cases = [
        (dict(piecewise_capture_sizes=[-1]), "piecewise_capture_sizes[0]: -1 is outside [0, 131072]"),
        (dict(piecewise_capture_sizes=[0, 16]), "piecewise_capture_sizes: 0 is not a positive token count"),
        (dict(piecewise_capture_sizes=list(range(1, 66))),
         "piecewise_capture_sizes: 65 values, more than the 64 it may hold"),
        (dict(piecewise_capture_sizes=[16, 128], max_num_batched_tokens=64),
         "piecewise_capture_sizes: 128 exceeds max_num_batched_tokens 64"),
        (dict(piecewise_capture_sizes=[16]), "piecewise_capture_sizes: given, but runtime_mode is compiled"),
    ]
    for fields, text in cases:
        with pytest.raises(grpc.RpcError) as exc:
            load_model(exec_stub, "tiny-bad-piecewise", **fields)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, exc.value.details())
        assert text in exc.value.details(), (fields, exc.value.details())


def test_piecewise_capture_sizes_within_the_step_budget():
    """The default sizes stop at the step token budget; a size over it is refused naming the field. Off ([0]) is no
    size at all, and so is any mode but cudagraph when none is asked for."""
    from exec_service.api.load_request import piecewise_capture_sizes

    def sizes(*asked: int, mode=RuntimeMode.CUDAGRAPH, budget=100):
        return piecewise_capture_sizes(exec_pb2.LoadModelRequest(piecewise_capture_sizes=asked), mode, budget)

    assert sizes() == (8, 16, 32, 48, 64, 96)
    assert sizes(0) == () and sizes(mode=RuntimeMode.COMPILED) == ()
    assert sizes(64, 16, 16) == (16, 64)
    with pytest.raises(InvalidArgument, match="piecewise_capture_sizes: 512 exceeds max_num_batched_tokens 256"):
        sizes(16, 512, budget=256)
    with pytest.raises(InvalidArgument, match="piecewise_capture_sizes: given, but runtime_mode is compiled"):
        sizes(16, mode=RuntimeMode.COMPILED)


def test_graphs_that_leave_no_kv_block_name_the_fields_to_lower():
    from exec_service.engine.kv.kv_cache import KVCacheSpec
    from exec_service.startup import kv_sizing
    from kiln.errors import ResourceExhausted

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    budget = kv_sizing.MemoryBudget(total_bytes=80 << 30, weights_bytes=70 << 30, activation_peak_bytes=1 << 30,
                                    cudagraph_bytes=9 << 30, kv_cache_bytes=0)
    with pytest.raises(ResourceExhausted, match="lower piecewise_capture_sizes or capture_sizes"):
        kv_sizing.num_blocks(budget, spec, 512)


def test_unload(exec_stub, exec_channel):
    load_model(exec_stub, "tiny-unload")
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-unload"))
    assert "tiny-unload" not in [m.name for m in exec_stub.ListModels(exec_pb2.ListModelsRequest()).models]
    health = health_pb2_grpc.HealthStub(exec_channel)
    with pytest.raises(grpc.RpcError) as exc:  # as for a name never loaded: the health protocol's NOT_FOUND
        health.Check(health_pb2.HealthCheckRequest(service="kiln.v1.ExecService/tiny-unload"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    for call in (lambda: generate(exec_stub, "tiny-unload", [1]),
                 lambda: exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-unload"))):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_forward_stats(exec_stub, tiny_loaded):
    generate(exec_stub, "tiny", [1, 2, 3], max_tokens=4)
    stats = exec_stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="tiny")).stats
    assert stats and all(s.model == "tiny" and s.count >= 1 and s.median_ms > 0 for s in stats)
    # The sum over every step: what the serving bench divides by wall time for the GPU's busy fraction.
    assert all(s.median_ms <= s.total_ms <= s.count * s.p99_ms + 1e-3 for s in stats)  # p99 is the max below 100
    assert {s.runtime_mode for s in stats} == {"compiled"}
    # One prompt, then its decodes: one batch size, two series (phase and path), never one median of both.
    assert {(s.batch_size, s.phase, s.path) for s in stats} >= {(1, "prefill", "compiled"), (1, "decode", "compiled")}
    assert len({(s.batch_size, s.phase, s.path) for s in stats}) == len(stats)
    # The decodes followed one another: each waited for the host's scheduling and inputs (the tracked gap), a few
    # ms at most on the tiny model; the prefill came to an idle engine, so its wait was for work, not counted.
    decode = next(s for s in stats if s.phase == "decode")
    assert 0 < decode.host_wait_ms < 1000 * decode.count
    exec_stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="tiny", reset=True))
    assert not exec_stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="tiny")).stats
    with pytest.raises(grpc.RpcError) as exc:
        exec_stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="nope"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_cli_generate_models_stats(exec_server, tiny_loaded, hf_tiny, capsys):
    from kiln_cli import main

    assert main(["generate", exec_server.address, "--model", "tiny", "--prompt-ids", "4,5,6", "--max-tokens", "5",
                 "--temperature", "0", "--ignore-eos", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens = [t for line in lines for t in line.get("token_ids", [])]
    assert tokens == hf_greedy(hf_tiny, [4, 5, 6], 5)
    assert lines[-1]["finish_reason"] == "FINISH_REASON_LENGTH" and lines[-1]["usage"]["output_tokens"] == 5

    assert main(["models", exec_server.address, "--json"]) == 0
    models = {m["name"]: m for m in map(json.loads, capsys.readouterr().out.splitlines())}
    assert models["tiny"]["state"] == "MODEL_STATE_READY"

    assert main(["stats", exec_server.address]) == 0
    out = capsys.readouterr().out
    assert "phase" in out.splitlines()[0] and "path" in out.splitlines()[0] and "host wait ms" in out.splitlines()[0]
    assert any(line.split()[2:4] == ["decode", "compiled"] for line in out.splitlines()[1:] if "tiny " in line)

    assert main(["generate", exec_server.address, "--model", "tiny", "--prompt-ids", "1", "--top-p", "2"]) == 1
    assert "INVALID_ARGUMENT: top_p" in capsys.readouterr().err


def test_cli_load_prints_each_phase(exec_server, tiny_loaded, capsys):
    from kiln_cli import main

    assert main(["load", exec_server.address, "tiny-llama", "--name", "tiny-cli", "--device", "cpu",
                 "--compile-sizes", "8", "--max-compiled-tokens", "128", "--stream-interval", "4"]) == 0
    out = capsys.readouterr().out
    for phase in PHASES[:-1]:
        assert f"  {phase}  " in out
    assert "# CPU blocks:" in out and "ready:" in out and "streams 4 tokens a message" in out


def test_concurrent_generates_on_two_models(exec_stub, tiny_loaded, hf_tiny):
    load_model(exec_stub, "tiny-second")
    prompts = [prompt_of(n, salt) for salt, n in enumerate([8, 25])]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, exec_stub, name, p, max_tokens=12, temperature=0, ignore_eos=True)
                   for name in ("tiny", "tiny-second") for p in prompts]
        results = [f.result()[0] for f in futures]
    expected = [hf_greedy(hf_tiny, p, 12) for p in prompts]
    assert results == expected + expected


def test_loads_beside_generates_of_another_model_disturb_none(exec_stub, tiny_loaded, hf_tiny):
    """LoadModel after LoadModel (each unpickling a bundle) while four clients generate on another model: every
    Generate completes with transformers' tokens. Unpickling the split graph as an FX GraphModule re-traced it with
    nn.Module.__call__ patched process-wide, and the other model's steps failed INTERNAL ("module is not installed
    as a submodule"); kiln.compilation.piecewise.SplitForward traces nothing."""
    prompts = [prompt_of(n, salt) for salt, n in enumerate([5, 40, 150])]
    expected = [hf_greedy(hf_tiny, p, 16) for p in prompts]
    loading = threading.Event()
    loading.set()

    def client() -> list:
        outputs = []
        while loading.is_set():
            outputs += [generate(exec_stub, "tiny", p, max_tokens=16, temperature=0, ignore_eos=True)[0]
                        for p in prompts]
        return outputs

    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client) for _ in range(4)]
        try:
            for i in range(16):
                load_model(exec_stub, f"beside-{i}")
                exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=f"beside-{i}"))
        finally:
            loading.clear()
        outputs = [tokens for c in clients for tokens in c.result()]
    assert len(outputs) >= 12 and outputs == expected * (len(outputs) // 3)


def test_shared_store_is_read_in_place(compile_store, tiny_key, tiny_loaded, tmp_path, trusted_keys):
    """A replica on the compile service's volume needs no compile service for a bundle that is there."""
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, store=compile_store)
    server = BackgroundServer(lambda: start_exec_server(settings))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            events = load_model(stub, "tiny-shared")
            fetch = next(e.phase for e in events if e.HasField("phase") and e.phase.phase == "fetch"
                         and not e.phase.progress)
            assert fetch.detail == f"shared store {compile_store}, key {tiny_key}"
            assert len(generate(stub, "tiny-shared", [1, 2, 3], max_tokens=2, ignore_eos=True)[0]) == 2
            with pytest.raises(grpc.RpcError) as exc:  # not in the store, and nowhere to compile it
                list(stub.LoadModel(exec_pb2.LoadModelRequest(
                    name="tiny-elsewhere", model=TINY_MODEL,
                    config=common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=64))))
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            assert "no compile service" in exc.value.details() and f"in shared store {compile_store}" in \
                exc.value.details()
    finally:
        server.stop()
