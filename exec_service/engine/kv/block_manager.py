"""Paged KV blocks: which cache blocks each sequence holds, handed out and taken back as sequences grow and end; and
the prefix cache, full blocks known by their content (exec_service.engine.kv.block_hash) that later prompts reuse.

Prefix caching (vLLM's automatic prefix caching). Once every token of a block is computed (scheduled: the step that
writes it runs on the device before any later step that reads it), the block is registered under its hash. A block
is held by reference count, by every sequence whose table names it; when the last one lets go (it finished, was
preempted, cancelled, or the block fell out of its window) a registered block keeps its hash and joins the cached
free blocks, evicted least recently used only when a block with no content is wanted and none is left. A new
prefill looks up its full blocks in order and takes the longest run found, at most up to its last token (whose
logits it samples from), so the step computes only the rest: the same path as a later chunk of a chunked prefill.

With a KV window (every layer of the model has a sliding window; kiln.attention.windows), a block whose tokens are
all older than the window of a sequence's next query is never read again: the sequence lets go of it while it runs,
and its entry in the block table points at the null block instead (vLLM's SlidingWindowManager); a cache hit needs
and takes only the blocks its window reaches. The null block is the cache's last block, held by no sequence and
never written; the kernels never read a position outside a query's window, so they never read it either. The table
keeps its length, so a token's slot is still ``table[position // block_size]``.
"""

from collections import OrderedDict, deque

from exec_service.engine.kv.block_hash import extend_chain
from exec_service.engine.sequence import Sequence


class BlockManager:
    """Reference-counted blocks over ``num_blocks`` blocks of ``block_size`` tokens; a sequence's block table grows
    on demand.

    ``window`` > 0: the KV window in tokens; block ``num_blocks`` is then the null block (the cache holds one more).
    ``prefix_root``: the root of the block hashes (block_hash.model_root of the model served); None turns prefix
    caching off. The cache's counters: ``queried_tokens``, ``hit_tokens`` and ``evicted_blocks`` since the start
    (the tokens of every prefill lookup, those found cached, the cached blocks handed out for new content), and
    ``num_cached_blocks``, the blocks known by content now.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int = 0, prefix_root: bytes | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.null_block = num_blocks
        self.prefix_root = prefix_root
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._empty: deque[int] = deque(range(num_blocks))  # free and known by no content: handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, still known by content; least recent first
        self._registered: dict[Sequence, int] = {}  # how many leading blocks of its table register has seen
        self.peak_used_blocks = 0  # the most blocks held at once since the start
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    @property
    def caching(self) -> bool:
        return self.prefix_root is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted when wanted)."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens of keys and values holds at once, in steps of at most
        ``max_step_tokens``: all of them, or with a window the blocks that the window before a step's first token
        and the step's own tokens reach (window - 1 + step tokens, at any offset in a block)."""
        blocks = self.blocks_for(num_tokens)
        if not self.window:
            return blocks
        span = self.window - 1 + min(max_step_tokens, num_tokens)
        return min(blocks, self.blocks_for(span + self.block_size - 1))

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold ``num_tokens`` tokens of keys and values."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_missing(seq, num_tokens) <= self.num_free_blocks

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached prefix of ``seq``'s full blocks, leaving its last token to compute;
        nothing is taken yet (``take_cached``). Empty without caching or once it holds blocks.

        Without a window, the longest run of cached blocks from the first. With one, a prefix of ``n`` blocks needs
        only the blocks the window of the query at ``n * block_size`` reads (vLLM's SlidingWindowManager): the
        longest such ``n``, its earlier entries the null block.
        """
        if not self.caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        extend_chain(seq.block_hashes, self.prefix_root, seq.token_ids, self.block_size, limit)
        found = [self._by_hash.get(block_hash) for block_hash in seq.block_hashes[:limit]]
        if not self.window:
            end = found.index(None) if None in found else limit
            return found[:end]
        run = [0] * (limit + 1)  # run[i]: cached blocks in a row from block i
        for index in range(limit - 1, -1, -1):
            run[index] = run[index + 1] + 1 if found[index] is not None else 0
        for end in range(limit, 0, -1):
            first = self._first_in_window(end * self.block_size)
            if run[first] >= end - first:
                return [self.null_block] * first + found[first:end]
        return []

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Whether ``seq``, taking the ``cached`` blocks, gets blocks for ``num_tokens`` tokens: a cached block no
        one holds is one of the free blocks."""
        kept = cached[self._first_in_window(len(cached) * self.block_size):]  # the rest are null
        taken_from_free = sum(self._refs[block] == 0 for block in kept)
        needed = self.blocks_for(num_tokens) - len(cached) + taken_from_free
        return needed <= self.num_free_blocks

    def take_cached(self, seq: Sequence, cached: list[int]) -> int:
        """Give ``seq`` (holding nothing) the ``cached`` blocks of ``cached_prefix``, as computed tokens; returns
        their token count. With a window, the entries before its next query's window are the null block."""
        num_tokens = len(cached) * self.block_size
        for block in cached[self._first_in_window(num_tokens):]:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table.extend(cached)
        seq.num_computed_tokens = num_tokens
        self._registered[seq] = len(cached)
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += num_tokens
        self._note_peak()
        return num_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to cover ``num_tokens``; the caller checked ``can_allocate``."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"{seq.request_id}: {missing} blocks needed, {self.num_free_blocks} free")
        for _ in range(missing):
            block = self._empty.popleft() if self._empty else self._evict()
            self._refs[block] = 1
            seq.block_table.append(block)
        self._note_peak()

    def register_full_blocks(self, seq: Sequence) -> None:
        """Know ``seq``'s blocks that are full of computed tokens whose ids are known here by their hashes.

        A token sampled by a step in flight is not known yet: its block is registered a step later. A block whose
        hash another block has already stays unregistered (tables only grow, so the sequence keeps its own).
        """
        if not self.caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self._registered.get(seq, 0)
        if full <= start:
            return
        extend_chain(seq.block_hashes, self.prefix_root, seq.token_ids, self.block_size, full)
        for index in range(start, full):
            block, block_hash = seq.block_table[index], seq.block_hashes[index]
            if block != self.null_block and self._hash_of[block] is None and block_hash not in self._by_hash:
                self._by_hash[block_hash] = block
                self._hash_of[block] = block_hash
        self._registered[seq] = full

    def forget_cached(self) -> None:
        """Know no block by its content any more (a failed step may have left registered blocks half written)."""
        for block in self._by_hash.values():
            self._hash_of[block] = None
        self._by_hash.clear()
        self._empty.extend(self._evictable)
        self._evictable.clear()

    def free_outside_window(self, seq: Sequence) -> None:
        """Let go of the blocks of ``seq`` that lie wholly before the window of its next query.

        That query sits at ``num_computed_tokens`` and reads the positions after ``num_computed_tokens - window``;
        later queries read later ones. A step in flight may still read a block freed here: a block is written again
        only by a later step, which the device runs after it.
        """
        if not self.window:
            return
        table = seq.block_table
        end = min(self._first_in_window(seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] != self.null_block:  # the ones before were let go by an earlier call
            start -= 1
        for index in range(start, end):  # oldest first, the first of them evicted: a windowed hit needs the last
            self._release(table[index])
            table[index] = self.null_block

    def free(self, seq: Sequence) -> None:
        """Let go of every block of ``seq``: its keys and values are recomputed if it runs again, or found in the
        cache. Without a window its last blocks go nearest the cached free blocks' eviction end (a prefix without
        its first blocks reaches none), with one its first (a windowed hit needs a prefix's last blocks)."""
        for block in (seq.block_table if self.window else reversed(seq.block_table)):
            if block != self.null_block:
                self._release(block)
        self._registered.pop(seq, None)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def _first_in_window(self, num_computed_tokens: int) -> int:
        """The first block index that the window of a query at ``num_computed_tokens`` reads (0 without one)."""
        if not self.window:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def _release(self, block: int) -> None:
        refs = self._refs[block] - 1
        if refs < 0:
            raise RuntimeError(f"KV block {block} freed twice")
        self._refs[block] = refs
        if refs == 0:
            if self._hash_of[block] is None:
                self._empty.append(block)
            else:
                self._evictable[block] = None

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of[block]]
        self._hash_of[block] = None
        self.evicted_blocks += 1
        return block

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - self.num_free_blocks)
