"""Block tables: which physical blocks hold each sequence's tokens."""

from __future__ import annotations

from collections import Counter

from engine.block_pool import BlockPool


class KVCacheManager:
    """Owns every sequence's block table and allocates blocks on demand.

    Protocol: `allocate_slots(seq_id, num_tokens)` makes the table large enough for
    `num_tokens` tokens (all or nothing, False when blocks run out); `free(seq_id)`
    returns the table's blocks at once. A table never holds a block beyond what its
    tokens need, so waste per sequence stays below one block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_new_blocks(self, seq_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    def allocate_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Grows the table to hold `num_tokens` tokens; False (nothing changed) if it can't."""
        return self.grow(seq_id, num_tokens) is not None

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """`allocate_slots` returning the live table (None: blocks ran out, no change)."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if not self.pool.can_allocate(need):
            return None
        table = self._tables.setdefault(seq_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return table

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table:
            self.pool.free(table)

    def num_allocated_slots(self) -> int:
        return sum(len(t) for t in self._tables.values()) * self.block_size

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        """Every block is free or owned, ref counts match the tables, and (given each
        sequence's stored token count) every table is exactly as long as it needs."""
        owners: Counter[int] = Counter()
        for table in self._tables.values():
            owners.update(table)
        self.pool.check_integrity(dict(owners))
        for seq_id, n in (num_tokens or {}).items():
            have = len(self.block_table(seq_id))
            assert have == self.blocks_for(n), f"{seq_id}: {have} blocks for {n} tokens"
