"""On a CUDA device, through the real servers: greedy output equals transformers' own generate in float32, and
in bfloat16 each token is within rounding of transformers' float32 choice (tests/greedy_judge.py), CUDA-graph
replay gives the same tokens as the compiled function, and the overlapped engine keeps 64 concurrent streams
(cancelled, preempted, prefilled in chunks) equal to each run alone."""

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from conftest import BackgroundServer
from greedy_judge import assert_each_token_near_the_best
from test_engine import model_info, streams_together_then_alone, wait_until

from exec_service.engine.sampler import counter_uniform
from kiln.model.causal_lm import transformers_model
from kiln.model.spec import resolve
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from protos import common_pb2, exec_pb2, exec_pb2_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL_LLAMA = json.dumps({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
                          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                          "vocab_size": 2048, "max_position_embeddings": 1024, "tie_word_embeddings": False})
PROMPTS = [[5, 17, 300, 2], list(range(100, 137)), [9] * 70, list(range(1000, 1011))]
MAX_TOKENS = 24
SEED = 11


@pytest.fixture(scope="module")
def gpu_steps() -> list:
    """Every engine step of the module's exec server, as its step observers see them."""
    return []


@pytest.fixture(scope="module")
def gpu_servers(tmp_path_factory, signer, trusted_keys, gpu_steps):
    from compile_service.server import CompileServerSettings, start_compile_server
    from exec_service.server import ExecServerSettings, start_exec_server

    compile_server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", tmp_path_factory.mktemp("store"), signer)))
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address,
                                  cache_dir=tmp_path_factory.mktemp("cache"))
    exec_server = BackgroundServer(lambda: start_exec_server(settings, step_observers=[gpu_steps.append]))
    channel = grpc.insecure_channel(exec_server.address, options=CHANNEL_OPTIONS)
    yield exec_pb2_grpc.ExecServiceStub(channel)
    channel.close()
    exec_server.stop()
    compile_server.stop()


def _spec(dtype: str) -> common_pb2.ModelSpec:
    return common_pb2.ModelSpec(config_json=SMALL_LLAMA, dtype=dtype)


def _kiln_tokens(stub, name: str, dtype: str, mode) -> list[list[int]]:
    request = exec_pb2.LoadModelRequest(
        name=name, model=_spec(dtype), config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=256),
        weights_seed=SEED, max_model_len=512, max_num_seqs=8, runtime_mode=mode, kv_cache_bytes=256 << 20,
        capture_sizes=[1, 2, 4, 8] if mode == exec_pb2.RUNTIME_MODE_CUDAGRAPH else [])
    events = list(stub.LoadModel(request))
    assert events[-1].ready.runtime_mode == exec_pb2.RuntimeMode.Name(mode).removeprefix("RUNTIME_MODE_").lower()
    captured = [e.phase.detail for e in events if e.phase.progress and e.phase.detail.startswith("captured batch")]
    assert len(captured) == (4 if mode == exec_pb2.RUNTIME_MODE_CUDAGRAPH else 0)  # progress per captured size

    def generate(prompt):
        return [t for r in stub.Generate(exec_pb2.GenerateRequest(
            model=name, prompt_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
            for t in r.token_ids]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: decode batches of several sizes
        return list(pool.map(generate, PROMPTS))


def _transformers(dtype: str):
    """transformers' own model with the weights Kiln serves for ``dtype``, on its SDPA attention."""
    model = transformers_model(resolve(_spec(dtype), "cuda"), "cuda", seed=SEED)
    model.config._attn_implementation = "sdpa"
    return model


def _hf_tokens(dtype: str) -> list[list[int]]:
    causal_lm = _transformers(dtype)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device="cuda")
            generated = causal_lm.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                           do_sample=False, pad_token_id=0)
            out.append(generated[0, len(prompt):].tolist())
    return out


def test_greedy_matches_transformers_with_cuda_graphs_in_float32(gpu_servers):
    kiln = _kiln_tokens(gpu_servers, "small-float32", "float32", exec_pb2.RUNTIME_MODE_CUDAGRAPH)
    for prompt, got, want in zip(PROMPTS, kiln, _hf_tokens("float32"), strict=True):
        assert len(got) == MAX_TOKENS
        assert got == want, f"prompt of {len(prompt)} tokens"


def test_bfloat16_with_cuda_graphs_follows_transformers_float32(gpu_servers):
    """The served bf16 weights, read by transformers in float64 and in bf16, judge each of Kiln's tokens
    (tests/greedy_judge.py)."""
    kiln = _kiln_tokens(gpu_servers, "small-bfloat16", "bfloat16", exec_pb2.RUNTIME_MODE_CUDAGRAPH)
    served = _transformers("bfloat16")
    for prompt, got in zip(PROMPTS, kiln, strict=True):
        assert len(got) == MAX_TOKENS
        assert_each_token_near_the_best(served, prompt, got, 16)


def test_graph_replay_equals_compiled_without_graphs(gpu_servers):
    stub = gpu_servers
    graphed = _kiln_tokens(stub, "small-graphed", "float32", exec_pb2.RUNTIME_MODE_CUDAGRAPH)
    compiled = _kiln_tokens(stub, "small-compiled", "float32", exec_pb2.RUNTIME_MODE_COMPILED)
    assert graphed == compiled
    stats = stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="small-graphed")).stats
    assert {s.runtime_mode for s in stats} == {"cudagraph"}
    paths = {(s.phase, s.path) for s in stats}
    assert {("prefill", "mixed_graph"), ("decode", "full_graph")} <= paths
    assert {path for _, path in paths} == {"mixed_graph", "full_graph"}


def _streams(stub, gpu_steps, model: str, piecewise_capture_sizes: list[int]) -> tuple[list, set[str]]:
    """tests/test_engine.py's 66 streams on ``model``: each finished stream equals its request alone, a cancelled one
    a prefix of it. Returns the requests' tokens alone and the paths the steps took."""
    blocks = 40  # of 16 tokens, 128 KiB each for this model in float32: the streams need several times that
    events = list(stub.LoadModel(exec_pb2.LoadModelRequest(
        name=model, model=_spec("float32"), config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=256),
        weights_seed=SEED, max_model_len=512, max_num_seqs=64, runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH,
        kv_cache_bytes=blocks * 131072, max_num_batched_tokens=64, piecewise_capture_sizes=piecewise_capture_sizes)))
    assert events[-1].ready.num_kv_blocks == blocks
    cases, together, steps, alone = streams_together_then_alone(stub, model, gpu_steps)
    for case, (tokens, last), (expected, alone_last) in zip(cases, together, alone, strict=True):
        if last is None:
            assert tokens == expected[:len(tokens)], case
        else:
            assert tokens == expected and last.finish_reason == alone_last.finish_reason, case
    assert sum(last.usage.num_preemptions for _, last in together if last is not None) > 0
    assert "mixed" in {r.phase for r in steps} and {r.runtime_mode for r in steps} == {"cudagraph"}
    wait_until(lambda: model_info(stub, model).num_free_blocks == blocks)
    stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))
    return [tokens for tokens, _ in alone], {r.path for r in steps}


def test_concurrent_streams_with_cuda_graphs_equal_each_request_run_alone(gpu_servers, gpu_steps):
    """tests/test_engine.py's 66-stream harness on the GPU (greedy and seeded, cancelled, preempted, prefilled in
    chunks): CUDA graphs, Triton kernels, pinned step buffers and the overlapped engine; float32, so batch
    composition cannot flip a greedy choice. With mixed graphs on and off, token for token the same."""
    piecewise, paths = _streams(gpu_servers, gpu_steps, "small-streams", [])
    assert paths == {"full_graph", "mixed_graph"}  # every step within 64 tokens: nothing left to Python
    without, paths = _streams(gpu_servers, gpu_steps, "small-streams-no-piecewise", [0])
    assert paths == {"full_graph", "compiled"}
    assert piecewise == without


def test_forward_times_of_overlapped_steps_follow_each_other_on_the_wall_clock(gpu_servers, gpu_steps):
    """Steps are launched before the one ahead has run; each forward's start is placed from the device's timing of
    the step before, so consecutive forwards neither overlap nor start before their launch."""
    first_step = len(gpu_steps)
    _kiln_tokens(gpu_servers, "small-timed", "float32", exec_pb2.RUNTIME_MODE_CUDAGRAPH)
    steps = [r for r in gpu_steps[first_step:] if r.model == "small-timed"]
    assert len(steps) > MAX_TOKENS
    for before, after in zip(steps, steps[1:], strict=False):
        assert after.start_ns >= before.end_ns - 20_000, (before, after)  # 20 us of event-timer resolution
        # Its wait for the host ran from the step's end, after the forward's (the logits and the sampling).
        assert after.host_wait_ns <= after.start_ns - before.end_ns + 20_000, (before, after)
    assert sum(r.host_wait_ns >= 0 for r in steps) >= MAX_TOKENS - 1  # the decodes followed one another


def test_counter_noise_is_the_same_on_the_gpu_as_on_the_cpu():
    """The sampler's noise is integer arithmetic: a seed samples the same tokens on either device."""
    seeds = torch.tensor([0, 1, -7, 2**62 + 5, 123456789])
    positions = torch.tensor([0, 17, 5, 4000, 1])
    on_cpu = counter_uniform(seeds, positions, 32000)
    assert torch.equal(counter_uniform(seeds.cuda(), positions.cuda(), 32000).cpu(), on_cpu)
