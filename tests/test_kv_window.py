"""KV blocks outside every layer's window go back to the pool while a sequence runs (issue 16, part 2).

The block manager and the scheduler on their own: every position a step reads sits in a block the sequence still
holds, the blocks held stay within the bound admission counts, and every block comes back exactly once through
preemption, abort and finish, with steps scheduled before the one ahead is read (the overlapped engine). The KV
window of every family's tiny model. Through the real servers: a windowed tiny Mistral generating far past its
window, in a cache too small for the whole sequence, equals transformers' greedy output; windowed streams that are
preempted and cancelled each equal themselves run alone, no block leaked; a model with a global layer frees
nothing. ``-m gpu``: the long generation on CUDA with CUDA graphs, in float32, against transformers.
"""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from greedy_judge import assert_each_token_near_the_best
from test_engine import StreamCase, run_stream
from test_exec_service import generate, hf_greedy, model_info, prompt_of, wait_until
from test_model_families import FAMILY_CONFIGS, TINY, _expected_layers, reference_model

from exec_service.engine.kv.block_manager import BlockManager
from exec_service.engine.scheduler import ScheduledBatch, Scheduler
from exec_service.engine.sequence import SamplingParams, Sequence
from kiln.attention.windows import kv_window, layer_windows
from protos import common_pb2, exec_pb2

WINDOW = 20  # not a multiple of the block size: the window's first block is partly read
BLOCK_SIZE = 8
STEP_TOKENS = 32  # the engine's token budget: a 70-token prompt prefills in chunks, the later ones past the window
MISTRAL = dict(TINY, model_type="mistral", sliding_window=WINDOW)
QWEN2_GLOBAL_FIRST = dict(TINY, model_type="qwen2", num_hidden_layers=3, use_sliding_window=True,
                          sliding_window=WINDOW, max_window_layers=1)  # layer 0 global, 1 and 2 local
MISTRAL_BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads of 16, float32
SMALL_KV_BLOCKS = 12  # plus the null block
STREAM_KV_BLOCKS = 10  # a stream's peak is 8 (the window, a step's tokens, a partial block)


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


# The block manager and the scheduler alone, as the engine drives them (sampled tokens are made up: the model does
# not decide which blocks a step needs).

def windowed_seq(request_id: str, prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(request_id, list(range(3, 3 + prompt_len)), params, max_model_len=512)


def check_step(scheduler: Scheduler, batch: ScheduledBatch, seqs: list[Sequence]) -> None:
    """Every position a step's queries read is in a block its sequence holds, which are no more than admission
    counted on; no block is held twice or lost."""
    manager = scheduler.block_manager
    for entry in batch.entries:
        table = entry.seq.block_table
        first_read = max(0, entry.start - manager.window + 1)
        read = table[first_read // manager.block_size:blocks_for(entry.end, manager.block_size)]
        assert manager.null_block not in read, (entry.seq.request_id, entry.start, table)
        bound = manager.max_blocks_held(entry.seq.max_kv_tokens, scheduler.max_num_batched_tokens)
        assert sum(block != manager.null_block for block in table) <= bound
    held = [b for s in seqs for b in s.block_table if b != manager.null_block]
    assert len(held) == len(set(held)) and len(held) + manager.num_free_blocks == manager.num_blocks


def run_overlapped(scheduler: Scheduler, seqs: list[Sequence], abort_at: dict[int, str] | None = None) -> int:
    """Run to the end as the engine does (step N+1 scheduled before step N's tokens are read); ``abort_at``: step
    number -> request id to cancel then. Returns the steps run."""
    in_flight, steps = None, 0
    while scheduler.has_work or in_flight is not None:
        if abort_at and steps in abort_at:
            scheduler.abort(abort_at[steps])
        batch = scheduler.schedule()
        check_step(scheduler, batch, seqs)
        if in_flight is not None:
            scheduler.postprocess(in_flight, [7] * len(in_flight.sampling_entries))
        in_flight = batch if batch.entries else None
        steps += 1
        assert steps < 10_000
    return steps


def test_a_windowed_sequence_holds_few_blocks_and_gives_each_back_once():
    """49 tokens of KV (13 blocks of 4) run in a cache of 8: the blocks before the window (6) are freed as it goes."""
    manager = BlockManager(num_blocks=8, block_size=4, window=6)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    seq = windowed_seq("long", 10, 40)
    bound = manager.max_blocks_held(seq.max_kv_tokens, 8)  # the window's 5 tokens before a step and its 8
    assert manager.blocks_for(seq.max_kv_tokens) == 13 > manager.num_blocks >= bound == 4
    scheduler.add(seq)
    run_overlapped(scheduler, [seq])
    assert seq.is_finished and len(seq.output_token_ids) == 40
    assert manager.num_free_blocks == 8 and 3 <= manager.peak_used_blocks <= bound


def test_without_a_window_every_block_is_kept():
    manager = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    seq = windowed_seq("long", 10, 40)
    assert manager.max_blocks_held(seq.max_kv_tokens, 8) == 13
    scheduler.add(seq)
    run_overlapped(scheduler, [seq])
    assert manager.peak_used_blocks == 13 and manager.num_free_blocks == 16


def test_preempted_and_aborted_windowed_sequences_give_every_block_back_once():
    manager = BlockManager(num_blocks=10, block_size=4, window=6)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16)
    seqs = [windowed_seq(f"s{i}", 3 + 9 * i, 30 + 7 * i) for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
    run_overlapped(scheduler, seqs, abort_at={25: "s2", 40: "s4"})
    assert sum(s.num_preemptions for s in seqs) > 0
    assert all(s.is_finished for s in seqs) and manager.num_free_blocks == 10
    done = [s for s in seqs if s.request_id not in ("s2", "s4")]
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in done)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_kv_window_is_the_widest_window_when_every_layer_has_one(model_type):
    """The windows read from the op's calls equal what each family's config says per layer (test_model_families
    derives it independently); one global layer makes the KV window 0."""
    import json

    from kiln.model.causal_lm import build_model
    from kiln.model.spec import resolve

    raw = dict(TINY, **FAMILY_CONFIGS[model_type])
    module = build_model(resolve(common_pb2.ModelSpec(config_json=json.dumps(raw)), "cpu"), "cpu")
    expected = [window for window, _ in _expected_layers(module.config)]
    windows = layer_windows(module, "cpu")
    assert [windows[i] for i in range(len(windows))] == expected
    assert kv_window(windows) == (0 if 0 in expected else max(expected))


def test_a_window_no_sequence_outgrows_frees_nothing():
    """Mistral-7B's 4096-token window at max_model_len 4096: no block could ever be freed, so none is reserved."""
    import json

    from exec_service.engine.engine_config import EngineConfig
    from exec_service.engine.kv.kv_cache import KVCacheSpec
    from exec_service.startup import kv_sizing
    from exec_service.startup.weights import load_weights
    from kiln.model.spec import resolve
    from kiln.runtime_mode import RuntimeMode

    resolved = resolve(common_pb2.ModelSpec(config_json=json.dumps(MISTRAL)), "cpu")
    for max_model_len, expected in ((WINDOW + BLOCK_SIZE - 1, 0), (WINDOW + BLOCK_SIZE, WINDOW)):
        config = EngineConfig(device="cpu", runtime_mode=RuntimeMode.EAGER, max_model_len=max_model_len,
                              max_num_seqs=1, max_num_batched_tokens=8, block_size=BLOCK_SIZE,
                              gpu_memory_utilization=0.9, kv_cache_bytes=0, capture_sizes=(), max_num_waiting=1)
        loaded = load_weights(resolved, config, "dummy", 0)
        assert loaded.kv_window == expected
        spec = KVCacheSpec.from_config(resolved.config, BLOCK_SIZE, resolved.dtype)
        kv = kv_sizing.allocate(spec, 10, "cpu", loaded.kv_window)
        assert kv.num_blocks == (9 if expected else 10) and kv.caches[0].shape[1] == 10


# Through the real servers.

@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory):
    """Saved tiny models: a Mistral windowed on every layer and a Qwen2 with a global first layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = {}
    for name, fields in (("mistral", MISTRAL), ("qwen2", QWEN2_GLOBAL_FIRST)):
        fields = dict(fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(5)
        dirs[name] = tmp_path_factory.mktemp(f"window-{name}")
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dirs[name])
    return dirs


def load_windowed(stub, name: str, path, num_blocks: int, block_bytes: int = MISTRAL_BLOCK_BYTES,
                  **fields) -> exec_pb2.ModelSizing:
    """Eager (the op and the engine are what is tested here), ``num_blocks`` blocks of KV cache."""
    request = exec_pb2.LoadModelRequest(
        name=name, model=common_pb2.ModelSpec(hf_dir=str(path)), weights=str(path),
        config=common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=STEP_TOKENS),
        runtime_mode=exec_pb2.RUNTIME_MODE_EAGER, block_size=BLOCK_SIZE, kv_cache_bytes=num_blocks * block_bytes,
        **fields)
    return list(stub.LoadModel(request))[-1].ready


def test_a_long_generation_past_the_window_equals_transformers_in_a_small_cache(exec_stub, window_dirs):
    """70 prompt + 200 new tokens need 34 blocks of 8; the cache has 12. Greedy output equals transformers'."""
    path = window_dirs["mistral"]
    ready = load_windowed(exec_stub, "window-long", path, SMALL_KV_BLOCKS + 1)
    assert ready.kv_window == WINDOW and ready.num_kv_blocks == SMALL_KV_BLOCKS
    assert ready.kv_cache_bytes == (SMALL_KV_BLOCKS + 1) * MISTRAL_BLOCK_BYTES
    try:
        prompt, max_tokens = prompt_of(70, 1), 200
        assert blocks_for(len(prompt) + max_tokens - 1) == 34
        tokens, last = generate(exec_stub, "window-long", prompt, max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True)
        assert tokens == hf_greedy(reference_model(path), prompt, max_tokens)
        assert last.usage.num_preemptions == 0
        info = model_info(exec_stub, "window-long")
        # The window before a step's first token and the step's own tokens: (20 - 1 + 32) tokens, any offset.
        assert 4 <= info.peak_used_blocks <= blocks_for(WINDOW - 1 + STEP_TOKENS + BLOCK_SIZE - 1) == 8
        wait_until(lambda: model_info(exec_stub, "window-long").num_free_blocks == SMALL_KV_BLOCKS)
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="window-long"))


def test_windowed_streams_preempted_and_cancelled_equal_each_run_alone(exec_stub, window_dirs):
    """Eight windowed streams (greedy and seeded sampling, three cancelled) in 10 blocks, the most one stream holds
    and two more, so streams that run to their end are preempted by recompute however the eight arrive (in 12, one
    run of the whole suite preempted none of them); each equal to itself run alone, a cancelled one a prefix of it;
    every block comes back."""
    model = "window-streams"
    load_windowed(exec_stub, model, window_dirs["mistral"], STREAM_KV_BLOCKS + 1, max_num_seqs=8)
    rng = random.Random(16)
    cases = []
    for i in range(8):
        fields = dict(max_tokens=rng.randint(40, 90), ignore_eos=True)
        fields |= dict(temperature=0.0) if i % 2 else dict(temperature=1.0, top_k=50, seed=rng.randrange(1 << 31))
        cases.append(StreamCase([rng.randrange(3, 512) for _ in range(rng.randint(5, 70))], fields,
                                rng.randint(1, 30) if i % 3 == 0 else None))
    try:
        start = threading.Barrier(len(cases))
        with ThreadPoolExecutor(len(cases)) as pool:
            together = list(pool.map(lambda c: run_stream(exec_stub, model, c, start), cases))
        alone = [run_stream(exec_stub, model, StreamCase(c.prompt, c.fields, None)) for c in cases]
        for case, (tokens, last), (expected, _) in zip(cases, together, alone, strict=True):
            assert len(expected) == case.fields["max_tokens"]
            if last is None:
                assert case.cancel_after is not None and tokens == expected[:len(tokens)], case
            else:
                assert tokens == expected, case
        assert sum(last.usage.num_preemptions for _, last in together if last is not None) > 0
        wait_until(lambda: model_info(exec_stub, model).num_free_blocks == STREAM_KV_BLOCKS)
        assert model_info(exec_stub, model).num_running == 0
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))


def test_a_model_with_a_global_layer_frees_nothing(exec_stub, window_dirs):
    """Qwen2 with one global layer among local ones: every block is kept, and a sequence must fit whole."""
    model, blocks = "window-global", 24
    block_bytes = MISTRAL_BLOCK_BYTES * 3 // 2  # three layers
    ready = load_windowed(exec_stub, model, window_dirs["qwen2"], blocks, block_bytes)
    assert ready.kv_window == 0 and ready.num_kv_blocks == blocks
    try:
        generate(exec_stub, model, prompt_of(70), max_tokens=100, temperature=0.0, ignore_eos=True)
        assert model_info(exec_stub, model).peak_used_blocks == blocks_for(70 + 100 - 1) == 22
        with pytest.raises(grpc.RpcError) as exc:
            generate(exec_stub, model, prompt_of(70), max_tokens=200)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "269 tokens need 34 KV blocks, the cache" in exc.value.details() and "has 24" in exc.value.details()
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_past_the_window_equal_transformers_in_float32(gpu_stub, window_dirs):
    """The long generation on CUDA: compiled, decode steps replayed from CUDA graphs (padded rows included), the
    Triton kernels over tables with freed blocks; each float32 token transformers' choice up to rounding
    (tests/greedy_judge.py), blocks held bounded."""
    stub = gpu_stub
    path, block_size, step_tokens = window_dirs["mistral"], 16, 64
    prompts, max_tokens = [prompt_of(5), prompt_of(40, 1), prompt_of(150, 2)], 120
    try:
        ready = list(stub.LoadModel(exec_pb2.LoadModelRequest(
            name="window-cuda", model=common_pb2.ModelSpec(hf_dir=str(path), dtype="float32"), weights=str(path),
            config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=step_tokens),
            runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH, capture_sizes=[1, 2, 4], max_num_seqs=4,
            block_size=block_size, kv_cache_bytes=64 << 20)))[-1].ready
        assert ready.kv_window == WINDOW and ready.runtime_mode == "cudagraph"
        assert ready.dtype == "float32"  # asked for: CUDA's default is bfloat16
        with ThreadPoolExecutor(len(prompts)) as pool:  # three decodes replay the graph of 4: one padded row
            results = list(pool.map(lambda p: generate(stub, "window-cuda", p, max_tokens=max_tokens,
                                                       temperature=0.0, ignore_eos=True)[0], prompts))
        served = reference_model(path).cuda()
        for prompt, tokens in zip(prompts, results, strict=True):  # within float32 rounding of the best, each token
            assert_each_token_near_the_best(served, prompt, tokens, max_tokens)
        per_seq = blocks_for(WINDOW - 1 + step_tokens + block_size - 1, block_size)
        assert model_info(stub, "window-cuda").peak_used_blocks <= len(prompts) * per_seq
        stats = stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model="window-cuda")).stats
        assert any(s.runtime_mode == "cudagraph" for s in stats)
    finally:
        stub.UnloadModel(exec_pb2.UnloadModelRequest(name="window-cuda"))
