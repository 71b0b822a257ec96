"""Prefix caching: the block pool on its own (hash chain, reference counts, LRU eviction), the scheduler starting a
prefill after its cached prefix, attention over cached context as a later chunk of a chunked prefill; then real
servers, caching on against caching off, token for token."""

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import torch
from conftest import load_model
from test_engine import CONFIG, outcome, tiny_runner
from test_kv_window import load_windowed, window_dirs  # noqa: F401  (a fixture)

from exec_service.engine.engine_loop import Engine
from exec_service.engine.kv.block_hash import block_hash, extend_chain, model_root
from exec_service.engine.kv.block_manager import BlockManager
from exec_service.engine.scheduler import Scheduler
from exec_service.engine.sequence import SamplingParams, Sequence
from exec_service.engine.step_inputs import StepBuffers
from kiln.attention import reference as attention_reference
from kiln.attention.forward_context import AttentionMetadata
from protos import common_pb2, exec_pb2

ROOT = model_root({"model": "test"})
GREEDY = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def seq(request_id: str, tokens: list[int], params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(request_id, list(tokens), params, max_model_len=1024)


def run_step(scheduler: Scheduler, token: int = 7):
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [token] * len(batch.sampling_entries))
    return batch


def prefill(manager: BlockManager, s: Sequence) -> None:
    """Take the cached prefix of ``s``, then compute the rest of it, as the scheduler admits it."""
    manager.take_cached(s, manager.cached_prefix(s))
    manager.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.register_full_blocks(s)


def test_the_hash_chain_covers_the_model_the_prefix_and_the_tokens():
    tokens = list(range(100, 132))
    hashes: list[bytes] = []
    extend_chain(hashes, ROOT, tokens, 8, 2)
    extend_chain(hashes, ROOT, tokens, 8, 4)  # extending a chain equals computing it at once
    whole: list[bytes] = []
    extend_chain(whole, ROOT, tokens, 8, 4)
    assert hashes == whole and len(set(hashes)) == 4 and all(len(h) == 32 for h in hashes)
    assert hashes[1] == block_hash(block_hash(ROOT, tokens[:8]), tokens[8:16])
    assert block_hash(ROOT, tokens[8:16]) != hashes[1], "the same tokens after another prefix"
    assert block_hash(model_root({"model": "other"}), tokens[:8]) != hashes[0], "another model"
    assert model_root({"a": 1, "b": "x"}) == model_root({"b": "x", "a": 1}), "canonical: key order does not count"
    assert block_hash(ROOT, [1, 256]) != block_hash(ROOT, [256, 1]), "fixed-width ids"


def test_a_later_prompt_takes_the_longest_cached_prefix_and_computes_at_least_its_last_token():
    manager = BlockManager(num_blocks=16, block_size=4, prefix_root=ROOT)
    first = seq("first", list(range(10, 21)))  # 11 tokens: blocks 0 and 1 full, block 2 partial
    prefill(manager, first)
    assert manager.num_cached_blocks == 2 and manager.hit_tokens == 0 and manager.queried_tokens == 11
    assert manager.cached_prefix(seq("same", first.token_ids)) == first.block_table[:2]
    assert manager.cached_prefix(seq("diverges", [*range(10, 15), 99, 16, 17])) == first.block_table[:1]
    assert manager.cached_prefix(seq("other", [99, *range(11, 21)])) == []
    # All 8 tokens are cached, but the last one must run for its logits: only the first block is a hit.
    aligned = seq("aligned", list(range(10, 18)))
    assert manager.cached_prefix(aligned) == first.block_table[:1]
    assert manager.take_cached(aligned, manager.cached_prefix(aligned)) == 4
    assert aligned.num_computed_tokens == 4 and manager.hit_tokens == 4
    assert BlockManager(16, 4).cached_prefix(seq("off", first.token_ids)) == [], "no root: caching off"


def test_shared_blocks_are_freed_when_the_last_holder_lets_go_and_never_twice():
    manager = BlockManager(num_blocks=8, block_size=4, prefix_root=ROOT)
    a, b = seq("a", list(range(9))), seq("b", list(range(9)))
    prefill(manager, a)
    prefill(manager, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert [manager.ref_count(x) for x in shared] == [2, 2] and manager.num_free_blocks == 4
    manager.free(a)
    assert [manager.ref_count(x) for x in shared] == [1, 1] and manager.num_free_blocks == 5
    manager.free(b)
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 2, "free, and still known by content"
    b.block_table.extend(shared)  # a table that names blocks it no longer holds
    with pytest.raises(RuntimeError, match="freed twice"):
        manager.free(b)


def test_cached_free_blocks_are_evicted_least_recently_used_last_blocks_first():
    manager = BlockManager(num_blocks=6, block_size=2, prefix_root=ROOT)
    old, new = seq("old", [1, 2, 3, 4, 5]), seq("new", [6, 7, 8, 9, 10])
    prefill(manager, old)
    prefill(manager, new)
    old_blocks, new_blocks = old.block_table[:2], new.block_table[:2]
    manager.free(old)
    manager.free(new)
    assert manager.num_cached_blocks == 4
    # Blocks known by no content go first; then the least recently freed, a sequence's last block before its first.
    taker = seq("taker", [50] * 5)
    manager.allocate(taker, 6)
    assert manager.num_cached_blocks == 3 and manager.cached_prefix(seq("o", old.token_ids)) == old_blocks[:1]
    assert manager.cached_prefix(seq("n", new.token_ids)) == new_blocks and manager.evicted_blocks == 1
    # A hit makes a block recent again: reusing old's first block, then evicting, takes new's blocks first.
    again = seq("again", [1, 2, 99])
    prefill(manager, again)
    manager.free(again)
    manager.allocate(seq("more", [51] * 3), 4)
    assert manager.cached_prefix(seq("o", old.token_ids)) == old_blocks[:1]
    assert manager.cached_prefix(seq("n", new.token_ids)) == []


def test_a_failed_step_forgets_every_cached_block():
    manager = BlockManager(num_blocks=4, block_size=2, prefix_root=ROOT)
    held, done = seq("held", [1, 2, 3]), seq("done", [4, 5, 6])
    prefill(manager, held)
    prefill(manager, done)
    manager.free(done)
    manager.forget_cached()
    assert manager.num_cached_blocks == 0 and manager.num_free_blocks == 2
    assert manager.cached_prefix(seq("h", held.token_ids)) == [] and manager.cached_prefix(seq("d", [4, 5, 6])) == []
    manager.free(held)
    assert manager.num_free_blocks == 4


def test_a_windowed_hit_takes_only_the_blocks_its_window_reads():
    manager = BlockManager(num_blocks=16, block_size=4, window=6, prefix_root=ROOT)
    first = seq("first", list(range(30)))
    prefill(manager, first)  # 7 full blocks registered before the window lets any go
    manager.free(first)
    later = seq("later", list(range(30)))
    cached = manager.cached_prefix(later)
    assert len(cached) == 7 and manager.can_admit(later, cached, 30)
    manager.take_cached(later, cached)
    # The query at 28 reads positions 23..28: block 5 on; blocks 0-4 stay free (and cached), the table names null.
    assert later.block_table == [manager.null_block] * 5 + cached[5:]
    assert manager.num_free_blocks == 14 and manager.num_cached_blocks == 7
    manager.free(later)
    assert manager.num_free_blocks == 16


def test_a_windowed_hit_needs_only_the_last_blocks_and_those_are_evicted_last():
    manager = BlockManager(num_blocks=10, block_size=4, window=6, prefix_root=ROOT)
    first = seq("first", list(range(30)))
    prefill(manager, first)
    blocks = first.block_table[:7]
    manager.free_outside_window(first)  # blocks 0-5 fall out of the window of the query at 30, oldest first
    assert first.block_table[:6] == [manager.null_block] * 6
    manager.free(first)
    manager.allocate(seq("taker", [99] * 24), 24)  # 6 blocks: the 3 known by nothing, then blocks 0, 1 and 2
    assert manager.evicted_blocks == 3
    later = seq("later", list(range(30)))
    assert manager.cached_prefix(later) == [manager.null_block] * 5 + blocks[5:7], "blocks 5 and 6 are enough"
    # Diverging in block 5: the longest end whose window is all cached is 5 blocks (the query at 20 reads 3 and 4).
    diverging = seq("diverging", [*range(22), 99, *range(23, 30)])
    assert manager.cached_prefix(diverging) == [manager.null_block] * 3 + blocks[3:5]
    assert BlockManager(10, 4, prefix_root=ROOT).cached_prefix(later) == []


def test_the_scheduler_starts_a_prefill_after_its_cached_prefix_and_chunks_the_rest():
    manager = BlockManager(num_blocks=32, block_size=4, prefix_root=ROOT)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    system = list(range(100, 118))  # 18 tokens: 4 full blocks and 2 tokens
    warm = seq("warm", [*system, 1, 2])
    scheduler.add(warm)
    while not warm.output_token_ids:
        run_step(scheduler)
    late = seq("late", [*system, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    scheduler.add(late)
    entries = [(e.seq.request_id, e.start, e.num_new_tokens) for e in run_step(scheduler).entries]
    assert entries == [("warm", 20, 1), ("late", 16, 7)], "16 cached tokens, then the 8-token budget"
    assert late.num_cached_tokens == 16 and late.usage().cached_tokens == 16
    assert [(e.start, e.num_new_tokens) for e in run_step(scheduler).entries if e.seq is late] == [(23, 5)]
    assert late.block_table[:4] == warm.block_table[:4]
    assert manager.hit_tokens == 16 and manager.queried_tokens == 20 + 28
    scheduler.abort("warm")
    scheduler.abort("late")
    assert manager.num_free_blocks == 32


def test_a_cache_hit_is_attention_over_the_cached_context_as_a_later_chunk():
    """The step inputs of a hit give the kernels the context length and the shared blocks: the hit's queries attend
    exactly as they did in the prefill that computed the prefix (the CPU reference; the Triton kernels take the same
    path, test_attention_triton)."""
    torch.manual_seed(0)
    manager = BlockManager(num_blocks=8, block_size=4, prefix_root=ROOT)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    buffers = StepBuffers(max_tokens=64, max_seqs=4, max_blocks_per_seq=8, block_size=4, vocab_size=512, device="cpu")
    prompt = list(range(10, 21))  # 11 tokens
    cache = torch.zeros(2, 8, 4, 2, 8)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    first = seq("first", prompt)
    scheduler.add(first)
    whole_inputs, _ = buffers.prepare(scheduler.schedule())
    whole = attention_reference.paged_attention(q, k, v, cache, whole_inputs.metadata, 0.3)
    scheduler.abort("first")

    scheduler.add(seq("hit", prompt))
    batch = scheduler.schedule()
    assert [(e.start, e.num_new_tokens) for e in batch.entries] == [(8, 3)]
    inputs, _ = buffers.prepare(batch)
    meta = inputs.metadata
    assert meta.seq_lens.tolist() == [11] and meta.query_start_loc.tolist() == [0, 3]
    assert inputs.positions.tolist() == [8, 9, 10] and inputs.input_ids.tolist() == prompt[8:]
    hit = attention_reference.paged_attention(q[8:], k[8:], v[8:], cache, meta, 0.3)
    torch.testing.assert_close(hit, whole[8:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_attends_a_cache_hit_as_the_whole_prefill():
    """On CUDA, the prefill kernel over cached context plus new tokens equals one whole prefill."""
    from kiln.attention import triton_kernels

    torch.manual_seed(0)
    cache = torch.zeros(2, 8, 16, 2, 64, device="cuda")
    q, k, v = (torch.randn(70, h, 64, device="cuda") for h in (4, 2, 2))
    table = torch.arange(8, dtype=torch.int32, device="cuda")[None, :]

    def meta(start: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(start, 70, device="cuda"),
            query_start_loc=torch.tensor([0, 70 - start], dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor([70], dtype=torch.int32, device="cuda"), block_tables=table,
            max_query_len=70 - start, num_seqs=1)

    whole = triton_kernels.paged_attention(q, k, v, cache, meta(0), 0.125)
    hit = triton_kernels.paged_attention(q[48:], k[48:], v[48:], cache, meta(48), 0.125)
    torch.testing.assert_close(hit, whole[48:], atol=2e-3, rtol=2e-3)


def tiny_engine(prefix_root: bytes | None) -> Engine:
    """The eager tiny model in process (tests/test_engine.py's), its steps failing on demand."""
    engine = Engine("tiny", tiny_runner(), CONFIG, frozenset(), prefix_root=prefix_root)
    engine.start()
    return engine


def test_after_a_failed_step_no_block_it_registered_is_reused():
    """The failed step had registered its prompt's full blocks, which it never wrote: the same prompt again
    computes them (cached_tokens 0) and equals caching off."""
    prompt = list(range(3, 53))  # 3 full blocks of 16
    cached, off = tiny_engine(ROOT), tiny_engine(None)

    def request(request_id: str) -> Sequence:
        return Sequence(request_id, list(prompt), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        max_model_len=CONFIG.max_model_len)

    async def run():
        cached.runner.execute.arm(1)
        failed = await outcome(cached, request("failed"))
        again = request("again")
        return failed, await outcome(cached, again), again, await outcome(off, request("off"))

    try:
        failed, again, seq, expected = asyncio.run(run())
    finally:
        cached.stop()
        off.stop()
    assert failed[1] is not None and again[1] is None and expected[1] is None
    assert seq.num_cached_tokens == 0 and again[0] == expected[0]
    assert cached.num_free_blocks == cached.runner.num_blocks


# Real servers: the session's exec server, the tiny model with caching off, on, and on with a small cache.

BLOCK = 16
STREAMS = 64
PREFIX_LENGTHS = (16, 40, 64, 23)  # one and four blocks, and two that end inside a block
SMALL_KV_BLOCKS = 16  # of 16 tokens (8 KiB each): the 64 streams need many times that
STREAM_TIMEOUT_S = 120  # a stream the engine never ends (its thread died) fails the test rather than hanging it
LOAD = ["--device", "cpu", "--compile-sizes", "8", "--max-num-batched-tokens", "128"]  # conftest's TINY_CONFIG


@dataclass(frozen=True)
class StreamCase:
    prompt: list[int]
    fields: dict  # the GenerateRequest's sampling fields
    cancel_after: int | None  # tokens the client takes before it cancels; None: it reads to the end
    shared: int  # tokens of the prompt shared with other prompts (its prefix)

    @property
    def expected_cached(self) -> int:
        """The shared prefix's full blocks, leaving the prompt's last token to compute."""
        return min(self.shared, len(self.prompt) - 1) // BLOCK * BLOCK


def prefixes(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PREFIX_LENGTHS]


def stream_cases(rng: random.Random, shared: list[list[int]]) -> list[StreamCase]:
    """Each prompt one of the shared prefixes and a suffix of its own; greedy and seeded; a third cancelled."""
    cases = []
    for i in range(STREAMS):
        prefix = shared[i % len(shared)]
        suffix = [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))]
        fields = dict(max_tokens=rng.randint(4, 20), ignore_eos=True)
        if (i // len(shared)) % 2:
            fields |= dict(temperature=rng.choice([0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
                           top_k=rng.choice([0, 20]), seed=rng.randrange(1 << 31))
        else:
            fields["temperature"] = 0.0
        cancel = rng.randint(0, fields["max_tokens"] - 1) if i % 3 == 0 else None
        cases.append(StreamCase(prefix + suffix, fields, cancel, len(prefix)))
    return cases


def run_stream(stub, model: str, case: StreamCase, start: threading.Barrier | None = None, cancel: bool = True):
    """(tokens received, last message or None when cancelled)."""
    if start is not None:
        start.wait()
    call = stub.Generate(exec_pb2.GenerateRequest(model=model, prompt_ids=case.prompt, **case.fields),
                         timeout=STREAM_TIMEOUT_S)
    cancel_after = case.cancel_after if cancel else None
    tokens, last = [], None
    try:
        if cancel_after == 0:
            call.cancel()
        for response in call:
            tokens += response.token_ids
            last = response
            if cancel_after is not None and len(tokens) >= cancel_after:
                call.cancel()
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED, exc
        return tokens, None
    return tokens, last


def run_together(stub, model: str, cases: list[StreamCase], cancel: bool = True) -> list:
    start = threading.Barrier(len(cases))
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda c: run_stream(stub, model, c, start, cancel), cases))


def model_info(stub, name: str) -> exec_pb2.ModelInfo:
    return next(m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models if m.name == name)


def wait_until_free(stub, name: str) -> exec_pb2.ModelInfo:
    """The model's info once every block is free again (a cancelled stream's blocks are freed between steps)."""
    for _ in range(500):
        info = model_info(stub, name)
        if info.num_free_blocks == info.sizing.num_kv_blocks and not info.num_running:
            return info
        threading.Event().wait(0.02)
    raise AssertionError(f"{name}: {info.num_free_blocks}/{info.sizing.num_kv_blocks} blocks free at the end")


@pytest.fixture(scope="module")
def shared_prefixes() -> list[list[int]]:
    return prefixes(random.Random(25))


@pytest.fixture(scope="module")
def cases(shared_prefixes) -> list[StreamCase]:
    return stream_cases(random.Random(2025), shared_prefixes)


@pytest.fixture(scope="module")
def reference(exec_server, exec_stub, tiny_key, cases) -> list:
    """Every case read to the end at once on the tiny model with caching off (``kiln load --no-prefix-caching``)."""
    from kiln_cli import main

    assert main(["load", exec_server.address, "tiny-llama", "--name", "pc-off", *LOAD, "--no-prefix-caching"]) == 0
    results = run_together(exec_stub, "pc-off", cases, cancel=False)
    assert all(last is not None and last.usage.cached_tokens == 0 for _, last in results)
    info = wait_until_free(exec_stub, "pc-off")
    assert not info.sizing.prefix_caching and info.prefix_cache_queried_tokens == 0 and not info.prefix_cache_blocks
    return results


def assert_streams_equal(cases, together, reference, at_least: int = STREAMS // 2) -> int:
    """Every finished stream equal to caching off token for token, a cancelled one a prefix; returns the finished."""
    finished = 0
    for case, (tokens, last), (expected, _) in zip(cases, together, reference, strict=True):
        if last is None:
            assert case.cancel_after is not None and tokens == expected[:len(tokens)], case
        else:
            finished += 1
            assert tokens == expected, case
            assert last.usage.output_tokens == len(expected) and last.usage.prompt_tokens == len(case.prompt)
    assert finished >= at_least
    return finished


def test_streams_on_a_warm_cache_reuse_their_prefix_and_equal_caching_off(exec_server, exec_stub, cases, reference,
                                                                         shared_prefixes, capsys):
    """The prefixes computed once (in chunks of 32 tokens), then 64 streams at once: each finished one's
    cached_tokens is its prefix's full blocks, its tokens those of caching off; no block is held at the end."""
    model = "pc-on"
    ready = load_model(exec_stub, model, max_num_batched_tokens=32).pop().ready
    assert ready.prefix_caching
    for prefix in shared_prefixes:
        warm = StreamCase(prefix + [1], dict(max_tokens=2, temperature=0.0), None, len(prefix))
        assert run_stream(exec_stub, model, warm)[1].usage.cached_tokens == 0
    together = run_together(exec_stub, model, cases)
    assert_streams_equal(cases, together, reference)
    for case, (_, last) in zip(cases, together, strict=True):
        if last is not None:
            assert last.usage.cached_tokens == case.expected_cached, case
    info = wait_until_free(exec_stub, model)
    # Each admitted stream looked once (no preemption on this cache); one cancelled early may never have been.
    warm_tokens = sum(len(p) + 1 for p in shared_prefixes)
    admitted = [c for c, (_, last) in zip(cases, together, strict=True) if last is not None]
    queried = info.prefix_cache_queried_tokens
    assert warm_tokens + sum(len(c.prompt) for c in admitted) <= queried <= warm_tokens + sum(len(c.prompt)
                                                                                           for c in cases)
    assert sum(c.expected_cached for c in admitted) <= info.prefix_cache_hit_tokens <= sum(c.expected_cached
                                                                                          for c in cases)
    assert info.prefix_cache_blocks > sum(p // BLOCK for p in PREFIX_LENGTHS) and not info.prefix_cache_evicted_blocks

    from kiln_cli import main

    assert main(["models", exec_server.address]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    rate = 100 * info.prefix_cache_hit_tokens / info.prefix_cache_queried_tokens
    assert f"prefix cache hits {rate:.1f}% of {queried} prompt tokens, {info.prefix_cache_blocks} blocks cached" \
        in lines[model]
    assert "prefix caching off" in lines["pc-off"]
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))


def test_streams_on_a_small_cache_are_preempted_evict_and_still_equal_caching_off(exec_stub, cases, reference):
    """16 blocks for 64 streams: sequences are preempted and cached blocks evicted, prompts split mid-prefix by the
    32-token step budget; every stream still equals caching off, and no block leaks or is freed twice (a second
    free raises in the engine thread, and the streams it leaves behind run out of time)."""
    model = "pc-small"
    ready = load_model(exec_stub, model, kv_cache_bytes=SMALL_KV_BLOCKS * 8192, max_num_batched_tokens=32).pop()
    assert ready.ready.num_kv_blocks == SMALL_KV_BLOCKS
    together = run_together(exec_stub, model, cases)
    assert_streams_equal(cases, together, reference)
    finished = [(case, last) for case, (_, last) in zip(cases, together, strict=True) if last is not None]
    assert all(last.usage.cached_tokens <= case.expected_cached and last.usage.cached_tokens % BLOCK == 0
               for case, last in finished)
    assert sum(last.usage.cached_tokens for _, last in finished) > 0
    assert sum(last.usage.num_preemptions for _, last in finished) > 0
    info = wait_until_free(exec_stub, model)
    assert info.prefix_cache_evicted_blocks > 0 and 0 < info.prefix_cache_blocks <= SMALL_KV_BLOCKS
    assert 0 < info.prefix_cache_hit_tokens < info.prefix_cache_queried_tokens
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))


def test_a_model_loaded_again_under_its_name_never_reuses_the_old_models_blocks(exec_stub, tiny_key):
    """Unload, load other weights under the same name: the same prompt finds nothing cached, and its tokens are the
    new model's (the same prompt again then hits the new model's own blocks, with the same tokens)."""
    prompt = StreamCase(list(range(3, 60)), dict(max_tokens=8, temperature=0.0, ignore_eos=True), None, 57)
    load_model(exec_stub, "pc-swap", weights_seed=0)
    old, old_last = run_stream(exec_stub, "pc-swap", prompt)
    assert run_stream(exec_stub, "pc-swap", prompt)[1].usage.cached_tokens == 48
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="pc-swap"))
    load_model(exec_stub, "pc-swap", weights_seed=1)
    new, new_last = run_stream(exec_stub, "pc-swap", prompt)
    assert old_last.usage.cached_tokens == 0 and new_last.usage.cached_tokens == 0 and new != old
    again, again_last = run_stream(exec_stub, "pc-swap", prompt)
    assert again == new and again_last.usage.cached_tokens == 48
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="pc-swap"))


def test_a_windowed_model_reuses_the_blocks_its_window_reads_and_equals_caching_off(exec_stub,
                                                                                    window_dirs):  # noqa: F811
    """The tiny Mistral windowed on every layer (20 tokens, blocks of 8): a shared 60-token prefix computed once,
    then five streams at once take its 7 full blocks as computed (holding only those their window reads) and equal
    caching off; every block comes back."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(60)]
    cases = [StreamCase(prefix + [rng.randrange(3, 512) for _ in range(rng.randint(5, 15))],
                        dict(max_tokens=30, ignore_eos=True, temperature=0.0) if i % 2 else
                        dict(max_tokens=30, ignore_eos=True, temperature=1.0, top_k=50, seed=i), None, len(prefix))
             for i in range(6)]
    for model, caching in (("pc-window-off", False), ("pc-window-on", True)):
        ready = load_windowed(exec_stub, model, window_dirs["mistral"], 129, enable_prefix_caching=caching)
        assert ready.kv_window == 20 and ready.prefix_caching is caching
    try:
        reference = run_together(exec_stub, "pc-window-off", cases)
        warm = run_stream(exec_stub, "pc-window-on", cases[0])
        together = [warm, *run_together(exec_stub, "pc-window-on", cases[1:])]
        assert_streams_equal(cases, together, reference, at_least=len(cases))
        assert [last.usage.cached_tokens for _, last in together] == [0] + [56] * 5
        info = wait_until_free(exec_stub, "pc-window-on")
        assert info.prefix_cache_hit_tokens == 5 * 56 and not info.prefix_cache_evicted_blocks
    finally:
        for model in ("pc-window-off", "pc-window-on"):
            exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_streams_with_cuda_graphs_equal_caching_off(gpu_stub, cases, shared_prefixes):
    """The 64 streams on CUDA (graphs, Triton kernels, the overlapped engine), float32 so that batch composition
    cannot flip a choice: caching on, warm and on a 16-block cache, equal to caching off token for token."""
    from test_gpu_generation import SEED, SMALL_LLAMA

    def load(name: str, caching: bool, blocks: int) -> exec_pb2.ModelSizing:
        return list(gpu_stub.LoadModel(exec_pb2.LoadModelRequest(
            name=name, model=common_pb2.ModelSpec(config_json=SMALL_LLAMA, dtype="float32"),
            config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=256), weights_seed=SEED,
            max_model_len=512, max_num_seqs=64, runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH,
            kv_cache_bytes=blocks * 131072, max_num_batched_tokens=32, enable_prefix_caching=caching)))[-1].ready

    assert not load("gpu-off", False, 512).prefix_caching
    reference = run_together(gpu_stub, "gpu-off", cases, cancel=False)
    assert load("gpu-on", True, 512).prefix_caching
    for prefix in shared_prefixes:
        run_stream(gpu_stub, "gpu-on", StreamCase(prefix + [1], dict(max_tokens=2, temperature=0.0), None, 0))
    together = run_together(gpu_stub, "gpu-on", cases)
    assert_streams_equal(cases, together, reference)
    assert all(last.usage.cached_tokens == case.expected_cached
               for case, (_, last) in zip(cases, together, strict=True) if last is not None)
    assert load("gpu-small", True, SMALL_KV_BLOCKS).num_kv_blocks == SMALL_KV_BLOCKS
    small = run_together(gpu_stub, "gpu-small", cases)
    assert_streams_equal(cases, small, reference)
    assert sum(last.usage.num_preemptions for _, last in small if last is not None) > 0
    for model in ("gpu-off", "gpu-on", "gpu-small"):
        wait_until_free(gpu_stub, model)
        gpu_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=model))


def test_the_sequences_of_one_request_share_its_prompts_blocks(exec_stub, tiny_key):
    """n = 3: the first sequence computes the prompt, the other two take its full blocks from the cache."""
    load_model(exec_stub, "pc-n")
    try:
        request = exec_pb2.GenerateRequest(model="pc-n", prompt_ids=list(range(3, 60)), max_tokens=4, temperature=1.0,
                                           seed=5, ignore_eos=True, n=3)
        cached = {r.index: r.usage.cached_tokens for r in exec_stub.Generate(request) if r.finish_reason}
        assert cached == {0: 0, 1: 48, 2: 48}
        wait_until_free(exec_stub, "pc-n")
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="pc-n"))
