"""Paged KV blocks: which cache blocks each sequence owns, handed out and taken back as sequences grow and end."""

from collections import deque

from exec_service.engine.sequence import Sequence


class BlockManager:
    """A free list over ``num_blocks`` blocks of ``block_size`` tokens; a sequence's block table grows on demand."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def free(self, seq: Sequence) -> None:
        """Give back every block of ``seq``; its keys and values are gone (recomputed if it runs again)."""
        self._free.extend(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
