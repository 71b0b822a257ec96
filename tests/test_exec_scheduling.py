"""Block manager, scheduler and sampler on their own: budgets, chunked prefill, preemption order, sampling rules."""

import dataclasses

import pytest
import torch

from exec_service.engine.kv.block_manager import BlockManager
from exec_service.engine.sampler import SamplingTensors, sample, unit_interval
from exec_service.engine.scheduler import Scheduler
from exec_service.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from exec_service.engine.step_inputs import StepBuffers
from kiln.attention import reference as attention_reference

GREEDY = SamplingParams(max_tokens=100, temperature=0.0)


def seq(request_id: str, prompt_len: int, params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(request_id, list(range(3, 3 + prompt_len)), params, max_model_len=512, eos_token_ids=frozenset({2}))


def run_step(scheduler: Scheduler, token: int = 7):
    """One step as the engine runs it, with every sampling sequence getting ``token``."""
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [token] * len(batch.sampling_entries))
    return batch


def test_blocks_are_allocated_on_demand_and_freed():
    manager = BlockManager(num_blocks=4, block_size=16)
    s = seq("a", 20)
    assert manager.blocks_missing(s, 20) == 2 and manager.can_allocate(s, 64) and not manager.can_allocate(s, 65)
    manager.allocate(s, 20)
    assert len(s.block_table) == 2 and manager.num_free_blocks == 2
    manager.allocate(s, 32)
    assert len(s.block_table) == 2, "32 tokens still fit in two blocks"
    manager.free(s)
    assert manager.num_free_blocks == 4 and s.block_table == [] and s.num_computed_tokens == 0


def test_long_prompts_prefill_in_chunks_beside_decodes():
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=32)
    short, long = seq("short", 4), seq("long", 70)
    scheduler.add(short)
    scheduler.add(long)
    first = run_step(scheduler)
    assert [(e.seq.request_id, e.num_new_tokens) for e in first.entries] == [("short", 4), ("long", 28)]
    assert first.phase == "prefill" and [e.seq.request_id for e in first.sampling_entries] == ["short"]
    second = run_step(scheduler)
    assert [(e.seq.request_id, e.start, e.num_new_tokens) for e in second.entries] == [("short", 4, 1),
                                                                                      ("long", 28, 31)]
    assert second.phase == "mixed" and second.num_tokens == 32
    third = run_step(scheduler)
    assert [(e.seq.request_id, e.num_new_tokens) for e in third.entries] == [("short", 1), ("long", 11)]
    assert long.output_token_ids == [7] and third.sampling_entries[-1].seq is long
    assert run_step(scheduler).is_decode_only


def test_max_num_seqs_leaves_the_rest_waiting():
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        scheduler.add(seq(str(i), 5))
    assert [e.seq.request_id for e in run_step(scheduler).entries] == ["0", "1"]
    assert [s.request_id for s in scheduler.waiting] == ["2"]


def test_preemption_takes_the_newest_and_it_recomputes_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = seq("old", 7), seq("new", 7)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefill 7 tokens into 2 blocks each: the cache is full
    run_step(scheduler)  # both decode token 8, which still fits their second block
    assert manager.num_free_blocks == 0
    batch = run_step(scheduler)  # token 9 of "old" needs a third block: "new" is preempted
    assert [e.seq.request_id for e in batch.entries] == ["old"]
    assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1 and new.block_table == []
    assert list(scheduler.waiting) == [new] and new.num_computed_tokens == 0
    scheduler.abort("old")
    batch = run_step(scheduler)
    # The preempted sequence recomputes its prompt and its sampled tokens in one prefill, then samples on.
    assert [(e.seq.request_id, e.start, e.num_new_tokens) for e in batch.entries] == [("new", 0, 9)]
    assert batch.phase == "prefill" and new.output_token_ids == [7, 7, 7]


def test_abort_frees_blocks_wherever_the_request_is():
    manager = BlockManager(16, 16)
    scheduler = Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=64)
    running, waiting = seq("running", 20), seq("waiting", 20)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    assert manager.num_free_blocks == 14
    assert scheduler.abort("waiting") is waiting and scheduler.abort("running") is running
    assert manager.num_free_blocks == 16 and not scheduler.has_work and scheduler.abort("running") is None


def entries_of(batch) -> list[tuple[str, int, int]]:
    return [(e.seq.request_id, e.start, e.num_new_tokens) for e in batch.entries]


def test_the_next_step_is_scheduled_before_this_ones_tokens_are_read():
    """As the overlapped engine runs: schedule N+1, then read N. A decode of a token still in flight is scheduled
    against it; a token sampled for a sequence that finished meanwhile is dropped; a sequence whose last token is
    in flight is left out."""
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64)
    stops = seq("stops", 4, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=frozenset({9})))
    short = seq("short", 3, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    for s in (stops, short):
        scheduler.add(s)
    first = scheduler.schedule()
    assert entries_of(first) == [("stops", 0, 4), ("short", 0, 3)]
    assert stops.num_pending == 1 and stops.num_computed_tokens == 4 and stops.num_tokens == 4
    second = scheduler.schedule()  # first's tokens are not read yet: each decodes its pending token
    assert entries_of(second) == [("stops", 4, 1), ("short", 3, 1)]
    assert stops.num_pending == 2 and short.reaches_max_tokens
    assert scheduler.postprocess(first, [9, 5]) == [(first.entries[0], 9), (first.entries[1], 5)]
    assert stops.finish_reason == FinishReason.STOP and scheduler.running == [short]
    assert not scheduler.schedule().entries  # short's last token is in flight, stops is done
    kept = scheduler.postprocess(second, [7, 6])
    assert [(e.seq.request_id, t) for e, t in kept] == [("short", 6)]  # stops' speculative token is dropped
    assert stops.output_token_ids == [9] and short.output_token_ids == [5, 6] and short.is_finished
    assert not scheduler.has_work and scheduler.block_manager.num_free_blocks == 64


def test_a_sequence_preempted_or_aborted_in_flight_keeps_or_drops_its_token():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    old, new, gone = seq("old", 7), seq("new", 7), seq("gone", 2)
    for s in (old, new):
        scheduler.add(s)
    run_step(scheduler)  # both prefill 7 tokens into 2 blocks each: the cache is full
    in_flight = scheduler.schedule()  # both decode token 8 (position 7): still their second block
    assert entries_of(in_flight) == [("old", 7, 1), ("new", 7, 1)] and manager.num_free_blocks == 0
    batch = scheduler.schedule()  # old's position 8 needs a third block: new goes, its token still in flight
    assert entries_of(batch) == [("old", 8, 1)] and new.status is SequenceStatus.WAITING and new.num_pending == 1
    scheduler.abort("old")
    scheduler.add(gone)
    assert entries_of(scheduler.schedule()) == [], "new waits for its token; gone may not pass it"
    scheduler.postprocess(in_flight, [11, 12])
    scheduler.postprocess(batch, [13])
    assert old.output_token_ids == [7] and new.output_token_ids == [7, 12]  # old's in-flight tokens: dropped
    assert entries_of(run_step(scheduler)) == [("new", 0, 9), ("gone", 0, 2)]  # recompute, with the token kept
    assert new.output_token_ids == [7, 12, 7]


def test_step_inputs_take_a_pending_token_from_the_previous_steps_output_and_pad_for_a_graph():
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq("a", 5), seq("b", 3, SamplingParams(temperature=0.5, top_k=7, seed=3))
    scheduler.add(a)
    scheduler.add(b)
    buffers = StepBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=8, block_size=4, vocab_size=512, device="cpu")
    first, _ = buffers.prepare(scheduler.schedule())
    assert first.input_ids.tolist() == a.token_ids + b.token_ids and first.sample_rows.tolist() == [4, 7]
    assert first.metadata.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]  # a: blocks 0, 1; b: block 2
    previous = torch.tensor([101, 202])  # the first step's sampled ids, still "on the device"
    second, _ = buffers.prepare(scheduler.schedule(), padded_seqs=4, previous_sampled=previous,
                                previous_rows={a: 0, b: 1})
    assert second.input_ids.tolist() == [101, 202, 0, 0] and second.positions.tolist() == [5, 3, 0, 0]
    meta = second.metadata
    assert meta.slot_mapping.tolist() == [5, 11, -1, -1] and meta.seq_lens.tolist() == [6, 4, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and (meta.num_seqs, meta.max_query_len) == (2, 1)
    assert meta.block_tables[:2, :2].tolist() == [[0, 1], [2, 0]]
    sampling = second.sampling
    assert sampling.positions.tolist() == [6, 4] and sampling.seeds.tolist() == [a.noise_seed, 3]
    assert sampling.top_k.tolist() == [512, 7] and not sampling.all_greedy and sampling.any_top_k_top_p


def test_a_step_padded_for_a_mixed_graph_writes_and_reads_the_real_tokens_only():
    """A mixed step of 11 tokens padded to a mixed graph of 16: the padding tokens are in no sequence with slot -1,
    the padding sequence rows (up to the 8 a 16-token graph holds here) have no query and an empty context, so
    attention leaves the KV cache as the unpadded step leaves it and gives the padding tokens zeros; the real rows
    are the unpadded ones."""
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for name, length in (("a", 3), ("b", 2)):
        scheduler.add(seq(name, length))
    run_step(scheduler)  # a and b prefill; next: their decodes
    scheduler.add(seq("c", 9))
    batch = scheduler.schedule()
    assert batch.phase == "mixed" and batch.num_tokens == 11
    buffers = StepBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=8, block_size=4, vocab_size=512, device="cpu")
    plain, _ = buffers.prepare(batch)
    plain_ids, m = plain.input_ids.clone(), plain.metadata  # copies: the next prepare fills the same buffers
    plain_meta = dataclasses.replace(m, slot_mapping=m.slot_mapping.clone(), query_start_loc=m.query_start_loc.clone(),
                                     seq_lens=m.seq_lens.clone(), block_tables=m.block_tables.clone())
    padded, _ = buffers.prepare(batch, padded_tokens=16)
    meta = padded.metadata
    assert padded.num_tokens == 16 and padded.input_ids[:11].tolist() == plain_ids.tolist()
    assert meta.slot_mapping[11:].tolist() == [-1] * 5
    assert meta.slot_mapping[:11].tolist() == plain_meta.slot_mapping.tolist()
    assert meta.query_start_loc.tolist() == [0, 1, 2] + [11] * 6 and meta.seq_lens.tolist() == [4, 3, 9] + [0] * 5
    assert (meta.num_seqs, meta.num_decodes, meta.max_query_len) == (3, 2, 9)

    torch.manual_seed(0)
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    cache = torch.randn(2, 16, 4, 2, 8)
    unpadded_cache, padded_cache = cache.clone(), cache.clone()
    unpadded = attention_reference.paged_attention(q[:11], k[:11], v[:11], unpadded_cache, plain_meta, 0.3)
    out = attention_reference.paged_attention(q, k, v, padded_cache, meta, 0.3)
    assert torch.equal(padded_cache, unpadded_cache)
    torch.testing.assert_close(out[:11], unpadded)
    assert not out[11:].any()


def test_every_step_buffer_view_starts_16_bytes_aligned():
    """As the warm-ups' own tensors do: Triton builds a kernel per pointer alignment, so a misaligned view (the
    sequence lengths after 129 query starts, say) would build one while serving."""
    buffers = StepBuffers(max_tokens=37, max_seqs=129, max_blocks_per_seq=3, block_size=4, vocab_size=512, device="cpu")
    for packed in (buffers._long, buffers._float, buffers._int):
        for name in packed.offsets:
            assert packed.device_view(name).data_ptr() % 16 == 0, name


def test_stop_conditions():
    s = seq("s", 3, SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=frozenset({9})))
    s.append_token(2, 0.0)  # eos, not ignored
    assert s.finish_reason == FinishReason.STOP
    s = seq("s", 3, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    s.append_token(2, 0.0)
    assert not s.is_finished
    s.append_token(2, 0.0)
    assert s.finish_reason == FinishReason.LENGTH
    s = seq("s", 3, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=frozenset({9})))
    s.append_token(9, 0.0)
    assert s.finish_reason == FinishReason.STOP and s.output_token_ids == [9]


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(4, 50) * 3


def sampling(params: list[SamplingParams], positions: list[int] | None = None, vocab: int = 50) -> SamplingTensors:
    """The sampler's per-row tensors for ``params``, as the step buffers build them."""
    positions = positions if positions is not None else [1] * len(params)
    return SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k or vocab for p in params]), top_p=torch.tensor([p.top_p for p in params]),
        seeds=torch.tensor([p.seed or 0 for p in params]),
        positions=torch.tensor(positions), all_greedy=all(p.is_greedy for p in params),
        any_top_k_top_p=any(p.top_k or p.top_p < 1 for p in params))


def test_greedy_and_top_k_one_take_the_argmax(logits):
    argmax = logits.argmax(-1).tolist()
    assert sample(logits, sampling([GREEDY] * 4)).tolist() == argmax
    assert sample(logits, sampling([SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(4)])).tolist() \
        == argmax
    assert sample(logits, sampling([SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(4)])).tolist() \
        == argmax
    mixed = [GREEDY, SamplingParams(temperature=1.0, seed=3), GREEDY, SamplingParams(temperature=0.5, seed=4)]
    tokens = sample(logits, sampling(mixed)).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]


def test_sampling_stays_inside_top_k_and_top_p(logits):
    row = logits[:1].expand(400, -1)
    top5 = set(logits[0].topk(5).indices.tolist())
    tokens = sample(row, sampling([SamplingParams(temperature=1.0, top_k=5, seed=i) for i in range(400)]))
    assert set(tokens.tolist()) <= top5 and len(set(tokens.tolist())) > 1
    probs = logits[0].softmax(-1)
    ordered = probs.sort(descending=True)
    nucleus = set(ordered.indices[:int((ordered.values.cumsum(0) < 0.8).sum()) + 1].tolist())
    tokens = sample(row, sampling([SamplingParams(temperature=1.0, top_p=0.8, seed=i) for i in range(400)]))
    assert set(tokens.tolist()) <= nucleus


def test_sampled_tokens_follow_the_softmax_at_the_temperature(logits):
    """20,000 draws (one seed, successive positions) against softmax(logits / 0.8): a chi-square test."""
    draws, temperature = 20_000, 0.8
    params = [SamplingParams(temperature=temperature, seed=99)] * draws
    tokens = sample(logits[1:2].expand(draws, -1), sampling(params, positions=list(range(draws))))
    expected = (logits[1] / temperature).softmax(-1) * draws
    observed = torch.bincount(tokens, minlength=50).float()
    kept = expected >= 5  # the chi-square approximation needs expected counts of at least 5
    chi2 = ((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < 2 * int(kept.sum())  # ~ the degrees of freedom; a biased sampler lands far above
    assert observed[~kept].sum() < 5 * max(1, int((~kept).sum()))


def test_the_noise_never_reaches_zero_or_one():
    """The extreme hashes map strictly inside (0, 1), so every token's Gumbel noise is finite."""
    extremes = unit_interval(torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 1]))
    assert extremes.min() > 0 and extremes.max() < 1
    assert torch.isfinite(extremes.log().neg().log().neg()).all()


def test_a_seeded_request_samples_the_same_whatever_shares_its_step(logits):
    """The token depends on (seed, position, logits) only: not on the other rows or the row's place."""
    seeded = SamplingParams(temperature=1.0, seed=5)
    alone = [sample(logits[:1], sampling([seeded], [p])).item() for p in range(20)]
    crowd = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    batch = torch.cat([logits[1:], logits[:1]])
    crowded = [sample(batch, sampling([*crowd, seeded], [7, 8, 9, p]))[3].item() for p in range(20)]
    assert alone == crowded and len(set(alone)) > 1
    other_seed = [sample(logits[:1], sampling([SamplingParams(temperature=1.0, seed=6)], [p])).item()
                  for p in range(20)]
    assert other_seed != alone
