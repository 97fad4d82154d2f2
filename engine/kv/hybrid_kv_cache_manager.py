"""Block tables per KV cache group, all drawing on one pool (vLLM's hybrid allocator)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.kv.block_count import cdiv
from engine.kv.block_pool import BlockPool
from engine.kv.block_tables import BlockCopy
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv.prefix_hash import BlockHash, TokenSlice, chain_hashes

NULL_BLOCK = 0  # reserved: the table entry of a block a sliding window has let go
GroupTables = tuple[list[int], ...]  # one block table per group


class HybridKVCacheManager:
    """Every sequence's block tables, one per KV cache group of `layout`, over ONE pool.

    The same primitives as `KVCacheManager` (grow, fork, copy-on-write, free, swap,
    the prefix cache), applied to every group at once and all or nothing across groups,
    plus `slide`: a sliding-window group's blocks wholly before the window of the next
    query are freed, and their table entries become `NULL_BLOCK` (reserved at start-up:
    kernels never read a block before a window, so the entry only keeps positions).
    Tables stay positional: entry i of every group's table covers tokens
    [i * block_size, (i + 1) * block_size).

    Prefix caching is per group: each group hashes its blocks under its own key. A hit
    of h blocks needs every full-attention group to hold blocks 0..h-1 cached and every
    sliding-window group only the blocks the query at position h * block_size can see
    (those before its window are NULL in the adopted table).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVCacheLayout,
        *,
        enable_prefix_caching: bool = False,
        extra_key: int = 0,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.layout = layout
        self.pool = BlockPool(num_blocks + 1)  # + the null block
        if self.pool.allocate(1) != [NULL_BLOCK]:
            raise AssertionError("the null block must be block 0")
        self.cpu_pool = BlockPool(num_cpu_blocks + 1) if num_cpu_blocks else None
        if self.cpu_pool is not None:
            self.cpu_pool.allocate(1)  # CPU block 0 stands for NULL in swapped tables
        self.enable_prefix_caching = enable_prefix_caching
        self.keys = tuple(hash((extra_key, g)) for g in range(layout.num_groups))
        self._tables: dict[str, GroupTables] = {}
        self._swapped: dict[str, GroupTables] = {}  # seq_id -> its CPU tables
        self._hashes: dict[str, tuple[list[BlockHash], ...]] = {}  # per group, leading blocks

    # -- counts ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used - 1

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def num_cache_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def num_swapped_blocks(self) -> int:
        return self.cpu_pool.num_used - 1 if self.cpu_pool else 0

    def blocks_for(self, num_tokens: int, num_computed: int = 0) -> int:
        """Pages all groups need to hold `num_tokens` slots with `num_computed` of
        them computed (windowed groups hold only what the next query sees)."""
        return self.layout.blocks_needed(num_computed, num_tokens, self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        """The first group's table (`group_tables` has them all)."""
        tables = self._tables.get(seq_id)
        return tables[0] if tables else []

    def group_tables(self, seq_id: str) -> GroupTables:
        return self._tables.get(seq_id) or tuple([] for _ in self.layout.groups)

    def swapped_table(self, seq_id: str) -> list[int]:
        return [b for t in self._swapped.get(seq_id, ()) for b in t if b != NULL_BLOCK]

    # -- the primitives --------------------------------------------------------------
    def slide(self, seq_id: str, num_computed: int) -> int:
        """Frees each windowed group's blocks before the first key the query at
        `num_computed` can see; how many were freed."""
        tables = self._tables.get(seq_id)
        if not tables:
            return 0
        freed = []
        for group, table in zip(self.layout.groups, tables, strict=True):
            if group.sliding_window is None:
                continue
            first = max(0, num_computed - group.sliding_window + 1) // self.block_size
            for i in range(min(first, len(table))):
                if table[i] != NULL_BLOCK:
                    freed.append(table[i])
                    table[i] = NULL_BLOCK
        self.pool.free(freed)
        return len(freed)

    def grow(self, seq_id: str, num_tokens: int) -> GroupTables | None:
        """Every group's table holds `num_tokens` slots (all or nothing: None when
        blocks run out, nothing changed)."""
        tables = self.group_tables(seq_id)
        need = cdiv(num_tokens, self.block_size)
        missing = [max(0, need - len(t)) for t in tables]
        if not self.pool.can_allocate(sum(missing)):
            return None
        for table, n in zip(tables, missing, strict=True):
            table.extend(self.pool.allocate(n))
        self._tables[seq_id] = tables
        return tables

    def fork(self, parent_id: str, child_id: str, num_tokens: int = 0) -> GroupTables:
        """The child shares the parent's blocks holding its first `num_tokens` tokens
        (all when 0) in every group."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        parent = self.group_tables(parent_id)
        n = cdiv(num_tokens, self.block_size) if num_tokens else None
        if n is not None and any(n > len(t) for t in parent):
            raise ValueError(f"{parent_id!r} holds fewer than {num_tokens} tokens")
        tables = tuple(list(t[:n]) for t in parent)
        self.pool.fork(b for t in tables for b in t if b != NULL_BLOCK)
        self._tables[child_id] = tables
        full = num_tokens // self.block_size if num_tokens else None
        self._hashes[child_id] = tuple(
            h[:full] for h in self._hashes.get(parent_id, self._no_hashes())
        )
        return tables

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None:
        """Private copies of every group's shared blocks at positions >= `start`."""
        tables = self._tables.get(seq_id)
        if not tables:
            return []
        first, ref = start // self.block_size, self.pool.ref_count
        shared = [
            (t, i)
            for t in tables
            for i in range(first, len(t))
            if t[i] != NULL_BLOCK and ref(t[i]) > 1
        ]
        if not self.pool.can_allocate(len(shared)):
            return None
        copies = []
        for (table, i), dst in zip(shared, self.pool.allocate(len(shared)), strict=True):
            copies.append((table[i], dst))
            self.pool.free([table[i]])  # still owned by the other tables
            table[i] = dst
        return copies

    def free(self, seq_id: str) -> None:
        """Drops every group's table (or the swapped-out ones), tail blocks first."""
        tables = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if tables:
            self.pool.free(_live_tail_first(tables))
        swapped = self._swapped.pop(seq_id, None)
        if swapped:
            self.cpu_pool.free(_live_tail_first(swapped))

    # -- swapping --------------------------------------------------------------------
    def swap_out(self, seq_id: str) -> list[BlockCopy] | None:
        """Every group's live blocks move to CPU blocks (all or nothing)."""
        tables = self._tables.get(seq_id)
        live = [b for t in tables or () for b in t if b != NULL_BLOCK]
        if not tables or self.cpu_pool is None or not self.cpu_pool.can_allocate(len(live)):
            return None
        cpu = iter(self.cpu_pool.allocate(len(live)))
        swapped = tuple([NULL_BLOCK if b == NULL_BLOCK else next(cpu) for b in t] for t in tables)
        del self._tables[seq_id]
        self.pool.free(_live_tail_first(tables))
        self._swapped[seq_id] = swapped
        return _pairs(tables, swapped)

    def swap_in(self, seq_id: str) -> list[BlockCopy] | None:
        """The swapped tables come back onto new device blocks (all or nothing); the
        cached prefix is registered again."""
        swapped = self._swapped.get(seq_id)
        if swapped is None:
            return None
        live = sum(b != NULL_BLOCK for t in swapped for b in t)
        if not self.pool.can_allocate(live):
            return None
        device = iter(self.pool.allocate(live))
        tables = tuple(
            [NULL_BLOCK if b == NULL_BLOCK else next(device) for b in t] for t in swapped
        )
        del self._swapped[seq_id]
        self.cpu_pool.free(_live_tail_first(swapped))
        self._tables[seq_id] = tables
        for table, hashes in zip(tables, self._hashes.get(seq_id, ()), strict=False):
            for block, h in zip(table, hashes, strict=False):
                if block != NULL_BLOCK:
                    self.pool.cache(block, h)
        return _pairs(swapped, tables)

    # -- the prefix cache --------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Starts the (empty) tables of `seq_id` with the longest cached prefix every
        group can serve; how many tokens it holds (never the last token's block)."""
        if not self.enable_prefix_caching or seq_id in self._tables:
            return 0
        bs, end = self.block_size, (len(token_ids) - 1) // self.block_size
        hashes = [
            chain_hashes(None, lambda a, b: token_ids[a:b], 0, end, bs, key) for key in self.keys
        ]
        hits = end
        for g, group in enumerate(self.layout.groups):
            if group.sliding_window is None:
                hits = min(hits, self._leading_hits(hashes[g][:hits]))
        while hits and not all(self._serves(g, hashes[g], hits) for g in self._windowed()):
            hits -= 1
        if hits:
            self.adopt_prefix(seq_id, [h[:hits] for h in hashes])
        return hits * bs

    def adopt_prefix(self, seq_id: str, hashes: Sequence[Sequence[BlockHash]]) -> GroupTables:
        """Starts the empty tables of `seq_id` with the cached blocks of `hashes` (per
        group; a windowed group's blocks before the window stay NULL)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        tables = []
        for g, group_hashes in enumerate(hashes):
            first = self._first_needed(g, len(group_hashes))
            table = [NULL_BLOCK] * first
            for h in group_hashes[first:]:
                block = self.pool.lookup(h)
                if block is None:
                    raise ValueError(f"prefix hash {h} is not cached")
                table.append(block)
            self.pool.touch(table[first:])
            tables.append(table)
        self._tables[seq_id] = tuple(tables)
        self._hashes[seq_id] = tuple(list(h) for h in hashes)
        return self._tables[seq_id]

    def cache_computed(self, seq_id: str, tokens: TokenSlice, num_computed: int) -> None:
        """Registers, in every group, the live blocks the first `num_computed` tokens
        have filled since the last call."""
        tables = self._tables.get(seq_id)
        if not self.enable_prefix_caching or not tables:
            return
        chains = self._hashes.setdefault(seq_id, self._no_hashes())
        for table, chain, key in zip(tables, chains, self.keys, strict=True):
            done, end = len(chain), min(num_computed // self.block_size, len(table))
            if end <= done:
                continue
            parent = chain[-1] if chain else None
            for i, h in enumerate(
                chain_hashes(parent, tokens, done, end, self.block_size, key), done
            ):
                if table[i] != NULL_BLOCK:
                    self.pool.cache(table[i], h)
                chain.append(h)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # -- accounting --------------------------------------------------------------------
    def num_table_blocks(self) -> int:
        """Live blocks the tables would hold with no sharing at all."""
        return sum(b != NULL_BLOCK for ts in self._tables.values() for t in ts for b in t)

    def num_allocated_slots(self) -> int:
        return self.num_table_blocks() * self.block_size

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        """Every page is the null block, free, cached, or referenced exactly as often as
        tables hold it; the CPU pool likewise; (given token counts) each group's table
        covers exactly the sequence's slots."""
        owners: Counter[int] = Counter({NULL_BLOCK: 1})
        for tables in self._tables.values():
            owners.update(b for t in tables for b in t if b != NULL_BLOCK)
        self.pool.check_integrity(dict(owners))
        if self.cpu_pool is not None:
            cpu: Counter[int] = Counter({NULL_BLOCK: 1})
            for tables in self._swapped.values():
                cpu.update(b for t in tables for b in t if b != NULL_BLOCK)
            self.cpu_pool.check_integrity(dict(cpu))
        assert not self._tables.keys() & self._swapped.keys(), "a sequence is in both pools"
        for seq_id, n in (num_tokens or {}).items():
            for g, table in enumerate(self.group_tables(seq_id)):
                need = cdiv(n, self.block_size)
                assert len(table) == need, f"{seq_id} group {g}: {len(table)} entries, {n} tokens"

    # -- helpers ---------------------------------------------------------------------------
    def _no_hashes(self) -> tuple[list[BlockHash], ...]:
        return tuple([] for _ in self.layout.groups)

    def _windowed(self) -> list[int]:
        return [g for g, group in enumerate(self.layout.groups) if group.sliding_window]

    def _first_needed(self, g: int, num_blocks: int) -> int:
        """Group g's first block the query after `num_blocks` computed blocks sees."""
        window = self.layout.groups[g].sliding_window
        if window is None:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def _leading_hits(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(hashes) and self.pool.lookup(hashes[n]) is not None:
            n += 1
        return n

    def _serves(self, g: int, hashes: Sequence[BlockHash], hits: int) -> bool:
        """Whether windowed group g holds, cached, every block a hit of `hits` needs."""
        first = self._first_needed(g, hits)
        return all(self.pool.lookup(h) is not None for h in hashes[first:hits])


def _live_tail_first(tables: GroupTables) -> list[int]:
    """Every table's non-null blocks, later positions first (so a cached prefix's
    later blocks are evicted before its earlier, more shared ones)."""
    width = max((len(t) for t in tables), default=0)
    return [
        t[i] for i in reversed(range(width)) for t in tables if i < len(t) and t[i] != NULL_BLOCK
    ]


def _pairs(src: GroupTables, dst: GroupTables) -> list[BlockCopy]:
    return [
        (s, d)
        for ts, td in zip(src, dst, strict=True)
        for s, d in zip(ts, td, strict=True)
        if s != NULL_BLOCK
    ]
