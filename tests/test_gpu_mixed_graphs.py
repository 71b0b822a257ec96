"""On a CUDA device: mixed CUDA graphs for prefill and mixed steps. A padded step writes the KV of its real
tokens only, and nothing compiles, builds a Triton kernel or autotunes after a model is ready, whatever the workload
(prompts of 1 to 2,048 tokens, batches of 1 to 128, greedy and sampled, on a family with local and global layers and
soft caps), with CUDA graphs and, in FP8, with every step launched from Python. Token-for-token equality with mixed
graphs off is in tests/test_gpu_families.py and tests/test_gpu_generation.py.

    python -m pytest -m gpu tests/test_gpu_mixed_graphs.py
"""

import asyncio
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from conftest import BackgroundServer

from exec_service.api.load_request import load_target
from exec_service.engine.sequence import SamplingParams, Sequence
from exec_service.startup.fetch import COMPILE_CHANNEL_OPTIONS, BundleFetcher
from exec_service.startup.load_model import start_model
from kiln.compilation.counters import compile_counts
from kiln.model.roots import ModelRoots
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store.location import open_store
from protos import common_pb2, exec_pb2, exec_pb2_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 1024,
         "tie_word_embeddings": False}
# Local and global layers, a 16-token window, attention-logit and final soft caps (tests/test_gpu_families.py's
# Gemma 2), with room for 2,048-token prompts.
GEMMA2 = {"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256, "query_pre_attn_scalar": 256,
          "vocab_size": 2048, "max_position_embeddings": 4096, "sliding_window": 16, "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0}


@pytest.fixture(scope="module")
def graph_servers(tmp_path_factory, signer, trusted_keys):
    """A compile service, an exec service on it, and what an in-process start_model needs to use them too."""
    from compile_service.server import CompileServerSettings, start_compile_server
    from exec_service.server import ExecServerSettings, start_exec_server

    compile_server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", tmp_path_factory.mktemp("store"), signer)))
    cache = tmp_path_factory.mktemp("cache")
    steps: list = []
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address, cache_dir=cache)
    exec_server = BackgroundServer(lambda: start_exec_server(settings, step_observers=[steps.append]))
    channel = grpc.insecure_channel(exec_server.address, options=CHANNEL_OPTIONS)
    compile_channel = grpc.insecure_channel(compile_server.address, options=COMPILE_CHANNEL_OPTIONS)
    fetcher = BundleFetcher(open_store(cache, cache, read_only=False, verify=False), shared=False,
                            compile_channel=compile_channel, trusted=trusted_keys)
    yield exec_pb2_grpc.ExecServiceStub(channel), fetcher, steps
    channel.close()
    compile_channel.close()
    exec_server.stop()
    compile_server.stop()


def _request(name: str, config: dict, **fields) -> exec_pb2.LoadModelRequest:
    return exec_pb2.LoadModelRequest(
        name=name, model=common_pb2.ModelSpec(config_json=json.dumps(config), dtype=fields.pop("dtype", "float32")),
        config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=fields.pop("tokens", 256)),
        weights_seed=3, runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH, **fields)


def _started(fetcher: BundleFetcher, request: exec_pb2.LoadModelRequest, steps: list):
    return start_model(load_target(request, ModelRoots.for_server((), loopback=True)), fetcher, [steps.append],
                       lambda event: None)


def _prefill_once(engine, prompt: list[int]) -> list[int]:
    async def run() -> list[int]:
        seq = Sequence("kv", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), max_model_len=256)
        return [t async for out in engine.add_request(seq) for t in out.token_ids]

    return asyncio.run(run())


def _written_slots(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the [slots, 2, kv_heads, head_dim] entries of every slot that holds anything (the cache starts
    as zeros), in slot order."""
    out = []
    for cache in caches:
        slots = cache.permute(1, 2, 0, 3, 4).reshape(-1, 2, *cache.shape[3:])
        out.append(slots[slots.flatten(1).ne(0).any(dim=1)])
    return out


def test_a_padded_step_writes_the_kv_of_its_real_tokens_only(graph_servers):
    """A 37-token prefill replayed at 48 tokens: 37 slots written, each as the same prefill without graphs wrote it;
    the 11 padding tokens wrote none."""
    _, fetcher, steps = graph_servers
    prompt = [(11 * i + 5) % 2000 + 3 for i in range(37)]
    written, tokens = {}, {}
    for sizes in ([48], [0]):
        request = _request(f"kv-{sizes[0]}", LLAMA, max_model_len=256, max_num_seqs=4, kv_cache_bytes=4 << 20,
                           capture_sizes=[1, 2], piecewise_capture_sizes=sizes)
        started = _started(fetcher, request, steps)
        try:
            first = len(steps)
            tokens[sizes[0]] = _prefill_once(started.engine, prompt)
            (step,) = steps[first:]
            assert (step.path, step.padded_size) == (("mixed_graph", 48) if sizes[0] else ("compiled", 37))
            written[sizes[0]] = _written_slots(started.engine.runner.kv_cache.caches)
        finally:
            started.engine.stop()
    assert tokens[48] == tokens[0]
    for on, off in zip(written[48], written[0], strict=True):
        assert on.shape[0] == len(prompt) == off.shape[0]
        torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


def _kiln_kernels() -> list:
    from kiln.attention import triton_kernels
    from kiln.quantization import fp8_small_m

    return [k for module in (triton_kernels, fp8_small_m) for k in vars(module).values() if hasattr(k, "device_caches")]


def _triton_builds() -> set[tuple[str, str]]:
    """(kernel, specialisation) of every variant Triton's JIT has built of Kiln's kernels in this process (its own
    per-device kernel caches)."""
    return {(kernel.__name__, str(key)) for kernel in _kiln_kernels() for cache in kernel.device_caches.values()
            for key in cache[0]}


def _triton_cache_files() -> set[str]:
    """Files in Triton's cache directory: a kernel compiled anywhere in this process (Inductor's too) adds some."""
    from triton import knobs

    directory = Path(os.environ.get("TRITON_CACHE_DIR") or knobs.cache.dir)
    return {str(f.relative_to(directory)) for f in directory.rglob("*")} if directory.is_dir() else set()


def _autotunings() -> dict[str, int]:
    """Inductor's runtime autotuning runs (benchmarking a kernel's configs, coordinate descent), as torch records
    them."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: len(v) for k, v in compilation_time_metrics.items() if k.startswith("CachingAutotuner.")}


def _random_request(rng: random.Random, name: str) -> exec_pb2.GenerateRequest:
    length = rng.choice([1, 2, 3, 15, 16, 17, 31, 33]) if rng.random() < 0.3 else rng.randint(1, 2048)
    request = exec_pb2.GenerateRequest(model=name, prompt_ids=[rng.randrange(3, 2000) for _ in range(length)],
                                       max_tokens=rng.randint(1, 24), ignore_eos=True)
    if rng.random() < 0.5:
        request.temperature = 0.8
        request.top_k = rng.choice([0, 5, 50])
        request.top_p = rng.choice([1.0, 0.9])
        request.seed = rng.randrange(1 << 30)
    else:
        request.temperature = 0.0
    return request


@pytest.mark.parametrize("quantization, kv_cache_dtype, runtime_mode, paths", [
    ("", "", exec_pb2.RUNTIME_MODE_CUDAGRAPH, {"full_graph", "mixed_graph", "compiled"}),
    # every step launched from Python: Kiln's FP8 product at every row count 1-128, its row blocks warmed at load
    ("fp8", "", exec_pb2.RUNTIME_MODE_COMPILED, {"compiled"}),
    # an FP8 cache's decode tiles (one split, several) built by the warm-up, not by a batch size's first step
    ("fp8", "fp8_e4m3", exec_pb2.RUNTIME_MODE_CUDAGRAPH, {"full_graph", "mixed_graph", "compiled"}),
], ids=["bf16-graphs", "fp8-compiled", "fp8-kv-graphs"])
def test_nothing_compiles_builds_or_autotunes_after_ready(graph_servers, quantization, kv_cache_dtype, runtime_mode,
                                                          paths):
    stub, _, steps = graph_servers
    name = f"after-ready-{quantization or 'bf16'}-{kv_cache_dtype or 'model'}"
    request = _request(name, GEMMA2, dtype="bfloat16", tokens=2048, max_model_len=2100, max_num_seqs=128)
    request.runtime_mode = runtime_mode
    request.config.quantization = quantization
    request.kv_cache_dtype = kv_cache_dtype
    events = list(stub.LoadModel(request))
    assert bool(events[-1].ready.piecewise_capture_sizes) == (runtime_mode == exec_pb2.RUNTIME_MODE_CUDAGRAPH)
    before = (compile_counts(), _triton_builds(), _triton_cache_files(), _autotunings())
    first = len(steps)
    rng = random.Random(28)
    try:
        for batch in [1, 128, 7, 64, 2, 33, 100, 16]:
            with ThreadPoolExecutor(batch) as pool:
                outputs = list(pool.map(lambda r: [t for o in stub.Generate(r) for t in o.token_ids],
                                        [_random_request(rng, name) for _ in range(batch)]))
            assert all(outputs)
    finally:
        stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
    after = (compile_counts(), _triton_builds(), _triton_cache_files(), _autotunings())
    served = [s for s in steps[first:] if s.model == name]
    assert paths <= {s.path for s in served}
    assert {"prefill", "decode", "mixed"} <= {s.phase for s in served}
    assert after[0] == before[0], "Dynamo or Inductor compiled after ready"
    assert after[1] == before[1], f"Triton built Kiln kernels after ready: {sorted(after[1] - before[1])}"
    assert after[2] == before[2], f"kernels compiled into Triton's cache after ready: {sorted(after[2] - before[2])}"
    assert after[3] == before[3], f"Inductor autotuned after ready: {before[3]} -> {after[3]}"
