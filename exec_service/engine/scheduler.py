"""Continuous batching: each step takes the running decodes first, then running prefill chunks, then admits waiting
sequences, under two budgets (tokens per step, sequences at once).

A step mixes decodes (one token) with prefill chunks (up to the token budget), and decodes come first, so a long
prompt never stalls the sequences already generating. When the KV cache runs out, the newest running sequence not
yet in the step is preempted by recompute: its blocks are freed and it goes back to the front of the waiting queue.
A sequence admitted from the waiting queue starts after the longest prefix of its tokens the prefix cache holds
(BlockManager), so its first chunk is a later chunk of a chunked prefill.
With a KV window, each step first gives back the blocks that have fallen out of every running sequence's window.

The engine schedules step N+1 before it has read step N's tokens (they are still on the device): a sequence that
sampled in step N decodes that token in step N+1 (``Sequence.num_pending``), one whose last token is in flight is
left out, and ``postprocess`` drops the token of a sequence that finished or was aborted in the meantime.
"""

import time
from collections import deque
from dataclasses import dataclass

from exec_service.engine.kv.block_manager import BlockManager
from exec_service.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    start: int  # first token position run this step (the sequence's computed tokens before it)
    num_new_tokens: int
    samples: bool  # the step reaches the sequence's last token, so its logits give the next token

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start >= self.seq.num_prompt_tokens


@dataclass
class ScheduledBatch:
    entries: list[ScheduledSequence]

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def is_decode_only(self) -> bool:
        """One query token per sequence: the shape CUDA graphs are captured for."""
        return all(e.num_new_tokens == 1 for e in self.entries)

    @property
    def phase(self) -> str:
        decodes = sum(e.is_decode for e in self.entries)
        return "decode" if decodes == len(self.entries) else "prefill" if decodes == 0 else "mixed"

    @property
    def sampling_entries(self) -> list[ScheduledSequence]:
        return [e for e in self.entries if e.samples]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """The next step's sequences and token counts; empty when nothing can run (e.g. right after preemption)."""
        for seq in self.running:  # first, so what a window lets go serves this step before anything is preempted
            self.block_manager.free_outside_window(seq)
        budget = self.max_num_batched_tokens
        entries: list[ScheduledSequence] = []
        scheduled: set[Sequence] = set()
        preempted = False
        for decodes in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or seq.reaches_max_tokens:
                    continue
                if (seq.num_uncomputed_tokens == 1) != decodes:
                    continue
                num_new = min(seq.num_uncomputed_tokens, budget)
                victims = self._make_room(seq, num_new, scheduled)
                preempted = preempted or bool(victims)
                if seq in victims:
                    continue
                entries.append(self._run(seq, num_new))
                scheduled.add(seq)
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted while a step sampled for it: admitted once that token is read
                break
            cached = self.block_manager.cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_uncomputed_tokens - num_cached, budget)
            if not self.block_manager.can_admit(seq, cached, num_cached + num_new):
                break
            self.waiting.popleft()
            if self.block_manager.caching:
                self.block_manager.take_cached(seq, cached)
                if seq.first_scheduled_s is None:
                    seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append(self._run(seq, num_new))
            budget -= num_new
        return ScheduledBatch(entries)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[tuple[ScheduledSequence, int]]:
        """Append a step's sampled tokens to their sequences and retire the finished ones.

        Returns the entries whose token counts, with it: a sequence that finished by an earlier token or was aborted
        since the step was scheduled had a speculative slot in it, and its token is dropped.
        """
        kept = []
        now_s = time.perf_counter()
        for entry, token_id in zip(batch.sampling_entries, sampled, strict=True):
            seq = entry.seq
            seq.num_pending -= 1
            if seq.is_finished:
                continue
            seq.append_token(token_id, now_s)
            if seq.is_finished:
                self.drop(seq)
            kept.append((entry, token_id))
        return kept

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks at once; None when it is not here (already done)."""
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id:
                self.drop(seq)
                return seq
        return None

    def drop(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running or waiting queue, free its blocks, and mark it finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if not seq.is_finished:
            seq.status = SequenceStatus.FINISHED

    def _make_room(self, seq: Sequence, num_new: int, scheduled: set[Sequence]) -> list[Sequence]:
        """Preempt the newest running sequences not in this step until ``seq`` gets its blocks, ``seq`` itself
        last of all; returns the preempted."""
        victims = []
        while seq not in victims and not self.block_manager.can_allocate(seq, seq.num_computed_tokens + num_new):
            victim = next(s for s in reversed(self.running) if s not in scheduled)
            self._preempt(victim)
            victims.append(victim)
        return victims

    def _run(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = time.perf_counter()
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_new
        self.block_manager.register_full_blocks(seq)
        samples = seq.num_uncomputed_tokens == 0
        if samples:
            seq.num_pending += 1
        return ScheduledSequence(seq, start, num_new, samples)

    def _preempt(self, seq: Sequence) -> None:
        seq.preemptions.append((time.time_ns(), seq.num_computed_tokens))
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
