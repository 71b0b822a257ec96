"""Paged KV blocks: which cache blocks each sequence owns, handed out and taken back as sequences grow and end.

With a KV window (every layer of the model has a sliding window; kiln.attention.windows), a block whose tokens are
all older than the window of a sequence's next query is never read again: it goes back to the pool while the
sequence runs, and its entry in the block table points at the null block instead (vLLM's SlidingWindowManager).
The null block is the cache's last block, owned by no sequence and never written; the kernels never read a position
outside a query's window, so they never read it either. The table keeps its length, so a token's slot is still
``table[position // block_size]``.
"""

from collections import deque

from exec_service.engine.sequence import Sequence


class BlockManager:
    """A free list over ``num_blocks`` blocks of ``block_size`` tokens; a sequence's block table grows on demand.

    ``window`` > 0: the KV window in tokens; block ``num_blocks`` is then the null block (the cache holds one more).
    """

    def __init__(self, num_blocks: int, block_size: int, window: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.null_block = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.peak_used_blocks = 0  # the most blocks held at once since the start

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        return self.blocks_missing(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to cover ``num_tokens``; the caller checked ``can_allocate``."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{seq.request_id}: {missing} blocks needed, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(missing))
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - len(self._free))

    def free_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq`` that lie wholly before the window of its next query.

        That query sits at ``num_computed_tokens`` and reads the positions after ``num_computed_tokens - window``;
        later queries read later ones. A step in flight may still read a block freed here: a block is written again
        only by a later step, which the device runs after it.
        """
        if not self.window:
            return
        table = seq.block_table
        first_read = seq.num_computed_tokens - self.window + 1
        for index in range(min(first_read // self.block_size, len(table)) - 1, -1, -1):
            if table[index] == self.null_block:  # the ones before it were freed by an earlier call
                break
            self._free.append(table[index])
            table[index] = self.null_block

    def free(self, seq: Sequence) -> None:
        """Give back every block of ``seq``; its keys and values are gone (recomputed if it runs again)."""
        self._free.extend(block for block in seq.block_table if block != self.null_block)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
