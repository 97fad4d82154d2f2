"""Block tables per KV cache group, all drawing on one pool (vLLM's hybrid allocator)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.kv.block_count import cdiv
from engine.kv.block_tables import BlockCopy
from engine.kv.kv_cache_groups import KVCacheGroupKind, KVCacheLayout
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.prefix_hash import BlockHash, TokenSlice, chain_hashes

NULL_BLOCK = 0  # reserved: the table entry of a block a sliding window has let go


class HybridKVCacheManager(KVCacheManager):
    """Every sequence's block tables, one per KV cache group of `layout`, over ONE pool.

    A sequence's tables are kept (and sent to workers) as one list, interleaved by
    block position: entry `i * num_groups + g` is group g's block for tokens
    [i * block_size, (i + 1) * block_size). So every table op of `KVCacheManager`
    keeps its meaning in entries (the ledger, the block manager and the step plans'
    diffs need no other form), and a worker reads group g's table as `table[g::G]`.

    The primitives cover every group at once, all or nothing, plus `slide`: a
    sliding-window group's blocks wholly before the window of the next query are freed
    and their entries become `NULL_BLOCK` (reserved at start-up; kernels never read a
    block before a window, so the entry only keeps positions).

    A RECURRENT group (linear attention: a state per sequence in the page of the block
    holding its last computed token) is served as a window of two tokens
    (`KVCacheGroup.window`); `sees_context` adds that a state before a position exists
    only at a block boundary.

    Prefix caching is per group: each group hashes its blocks under its own key, and
    `_hashes` interleaves the chains like the tables. A hit of h blocks needs every
    full-attention group to hold blocks 0..h-1 cached and every sliding-window group
    only the blocks the query at position h * block_size can see.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        layout: KVCacheLayout,
        enable_prefix_caching: bool = False,
        extra_key: int = 0,
        num_cpu_blocks: int = 0,
    ) -> None:
        super().__init__(
            num_blocks + 1,  # + the null block
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            extra_key=extra_key,
            num_cpu_blocks=num_cpu_blocks + 1 if num_cpu_blocks else 0,
        )
        if self.pool.allocate(1) != [NULL_BLOCK]:
            raise AssertionError("the null block must be block 0")
        if self.cpu_pool is not None:
            self.cpu_pool.allocate(1)  # CPU block 0 stands for NULL in swapped tables
        self.layout = layout
        self.num_groups = layout.num_groups
        self.windows = tuple(g.window for g in layout.groups)  # recurrent: a window of 2
        self.recurrent = any(g.kind is KVCacheGroupKind.RECURRENT for g in layout.groups)
        self.has_windows = any(w is not None for w in self.windows)
        self.keys = tuple(hash((extra_key, g)) for g in range(self.num_groups))

    # -- counts ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used - 1

    @property
    def num_swapped_blocks(self) -> int:
        return self.cpu_pool.num_used - 1 if self.cpu_pool else 0

    def blocks_for(self, num_tokens: int, num_computed: int = 0) -> int:
        """Pages every group holds for `num_tokens` slots with `num_computed` of them
        computed (windowed groups only what the next query sees)."""
        return self.layout.blocks_needed(num_computed, num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """Pages every group holds at most while a sequence of `num_tokens` tokens is
        computed from its start in chunks of `max_chunk`: a windowed or recurrent group
        a chunk plus its window (`KVCacheLayout.max_blocks_per_sequence`)."""
        return self.layout.max_blocks_per_sequence(num_tokens, max_chunk, self.block_size)

    def entries_for(self, num_tokens: int) -> int:
        return self.num_groups * cdiv(num_tokens, self.block_size)

    def group_tables(self, seq_id: str) -> tuple[list[int], ...]:
        """Each group's own table (a copy)."""
        table = self.block_table(seq_id)
        return tuple(table[g :: self.num_groups] for g in range(self.num_groups))

    # -- the primitives --------------------------------------------------------------
    def slide(self, seq_id: str, num_computed: int) -> int:
        """Frees each windowed group's blocks before the first key the query at
        `num_computed` sees, on the device or (a swapped-out table) in the swap space;
        how many were freed."""
        if not self.has_windows:
            return 0
        table, pool = self._tables.get(seq_id), self.pool
        if table is None:
            table, pool = self._swapped.get(seq_id), self.cpu_pool
        if not table:
            return 0
        freed, groups = [], self.num_groups
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            first = self._first_needed(window, num_computed)
            for e in range(g, min(first * groups, len(table)), groups):
                if table[e] != NULL_BLOCK:
                    freed.append(table[e])
                    table[e] = NULL_BLOCK
        pool.free(freed)
        return len(freed)

    def sees_context(self, seq_id: str, position: int) -> bool:
        """Whether a query at `position` could be (re)computed on this table: every
        windowed group still holds the blocks it reads, and (recurrent groups) the
        state after position - 1 is a page's: `position` starts a block, since a
        block's page holds the state after its last computed token only."""
        if self.recurrent and position % self.block_size:
            return False
        table, groups = self.block_table(seq_id), self.num_groups
        for g, window in enumerate(self.windows):
            first = self._first_needed(window, position) * groups + g
            if any(
                b == NULL_BLOCK
                for b in table[first : (position // self.block_size + 1) * groups : groups]
            ):
                return False
        return True

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        table = self._tables.get(seq_id)
        entries = range(len(table) if table else 0, self.entries_for(num_tokens))
        if not entries:
            return table if table is not None else []
        if not self._can_allocate(entries):
            return None
        if table is None:
            table = self._tables[seq_id] = []
        table.extend(self._allocate(entries))
        return table

    def fork(self, parent_id: str, child_id: str, num_tokens: int = 0) -> list[int]:
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = list(self.block_table(parent_id))
        if num_tokens:
            if self.entries_for(num_tokens) > len(table):
                raise ValueError(f"{parent_id!r} holds fewer than {num_tokens} tokens")
            table = table[: self.entries_for(num_tokens)]
        self.pool.fork(_live(table))
        self._tables[child_id] = table
        hashes = self._hashes.get(parent_id, [])
        full = num_tokens // self.block_size * self.num_groups
        self._hashes[child_id] = hashes[:full] if num_tokens else hashes[:]
        return table

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None:
        table = self._tables.get(seq_id)
        if not table:
            return []
        ref = self.pool.ref_count
        first = start // self.block_size * self.num_groups
        shared = [
            e for e in range(first, len(table)) if table[e] != NULL_BLOCK and ref(table[e]) > 1
        ]
        if not self._can_allocate(shared):
            return None
        copies = []
        for e, dst in zip(shared, self._allocate(shared), strict=True):
            copies.append((table[e], dst))
            self.pool.free([table[e]])  # still owned by the other tables
            table[e] = dst
        return copies

    def _release(self, entries: list[int]) -> None:
        self.pool.free(_live(reversed(entries)))

    def _release_swapped(self, entries: list[int]) -> None:
        self.cpu_pool.free(_live(entries))

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if table:
            self._release(table)
        swapped = self._swapped.pop(seq_id, None)
        if swapped:
            self.cpu_pool.free(_live(swapped))

    # -- swapping ----------------------------------------------------------------------
    def swap_out(self, seq_id: str) -> list[BlockCopy] | None:
        table = self._tables.get(seq_id)
        live = _live(table or ())
        if not table or self.cpu_pool is None or not self.cpu_pool.can_allocate(len(live)):
            return None
        cpu = iter(self.cpu_pool.allocate(len(live)))
        swapped = [NULL_BLOCK if b == NULL_BLOCK else next(cpu) for b in table]
        del self._tables[seq_id]
        self.pool.free(_live(reversed(table)))
        self._swapped[seq_id] = swapped
        return _pairs(table, swapped)

    def swap_in(self, seq_id: str) -> list[BlockCopy] | None:
        swapped = self._swapped.get(seq_id)
        entries = [e for e, b in enumerate(swapped or ()) if b != NULL_BLOCK]
        if swapped is None or not self._can_allocate(entries):
            return None
        device = iter(self._allocate(entries))
        table = [NULL_BLOCK if b == NULL_BLOCK else next(device) for b in swapped]
        del self._swapped[seq_id]
        self.cpu_pool.free(_live(swapped))
        self._tables[seq_id] = table
        for block, h in zip(table, self._hashes.get(seq_id, ()), strict=False):
            if block != NULL_BLOCK:
                self.pool.cache(block, h)
        return _pairs(swapped, table)

    # -- the prefix cache --------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Starts the (empty) tables of `seq_id` with the longest cached prefix every
        group can serve; how many tokens it holds (never the last token's block)."""
        if not self.enable_prefix_caching or seq_id in self._tables:
            return 0
        bs, end = self.block_size, (len(token_ids) - 1) // self.block_size
        chains = [chain_hashes(None, lambda a, b: token_ids[a:b], 0, end, bs, k) for k in self.keys]
        hits = end
        for chain, window in zip(chains, self.windows, strict=True):
            if window is None:
                hits = min(hits, self._leading_hits(chain[:hits]))
        while hits and not all(
            self._serves(chain, window, hits)
            for chain, window in zip(chains, self.windows, strict=True)
            if window is not None
        ):
            hits -= 1
        if hits:
            self.adopt_prefix(seq_id, [c[i] for i in range(hits) for c in chains])
        return hits * bs

    def adopt_prefix(self, seq_id: str, hashes: list[BlockHash]) -> list[int]:
        """Starts the empty table of `seq_id` with the cached blocks of `hashes`
        (interleaved like tables); a windowed group's blocks before the window of the
        query after them stay NULL."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        num_blocks = len(hashes) // self.num_groups
        firsts = [self._first_needed(w, num_blocks * self.block_size) for w in self.windows]
        table = []
        for e, h in enumerate(hashes):
            if e // self.num_groups < firsts[e % self.num_groups]:
                table.append(NULL_BLOCK)
                continue
            block = self.pool.lookup(h)
            if block is None:
                raise ValueError(f"prefix hash {h} is not cached")
            table.append(block)
        self.pool.touch(_live(table))
        self._tables[seq_id] = table
        self._hashes[seq_id] = list(hashes)
        return list(table)

    def cache_computed(self, seq_id: str, tokens: TokenSlice, num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id)
        if not table:
            return
        chain, groups = self._hashes.get(seq_id, []), self.num_groups
        done = len(chain) // groups
        end = min(num_computed // self.block_size, len(table) // groups)
        if end <= done:
            return
        parents = chain[-groups:] if done else [None] * groups
        new = [
            chain_hashes(parent, tokens, done, end, self.block_size, key)
            for parent, key in zip(parents, self.keys, strict=True)
        ]
        self.register_blocks(seq_id, done * groups, [c[i] for i in range(end - done) for c in new])

    def register_blocks(self, seq_id: str, first: int, hashes: list[BlockHash]) -> None:
        """Caches the live entries first, first+1, ... of `seq_id` under `hashes`."""
        table = self._tables[seq_id]
        chain = self._hashes.setdefault(seq_id, [])
        if len(chain) != first or first + len(hashes) > len(table):
            raise ValueError(
                f"{seq_id!r}: entries {first}..{first + len(hashes) - 1} do not follow its "
                f"{len(chain)} hashed entries within its {len(table)}"
            )
        for e, h in enumerate(hashes, first):
            if table[e] != NULL_BLOCK:
                self.pool.cache(table[e], h)
        chain.extend(hashes)

    # -- accounting --------------------------------------------------------------------
    def needed_slots(self, num_tokens: int) -> int:
        """Per group, every token (full attention) or the last `window` (windowed; a
        recurrent group's state counts as one block), in page slots: a group of fewer
        than `layers_per_group` layers (the padded last chunk of a kind) fills that
        share of its pages' slots."""
        per_page = self.layout.layers_per_group
        return round(
            sum(
                _needed_tokens(g, num_tokens, self.block_size) * len(g.layers) / per_page
                for g in self.layout.groups
            )
        )

    def num_table_blocks(self) -> int:
        return sum(len(_live(t)) for t in self._tables.values())

    def num_allocated_slots(self) -> int:
        return self.num_table_blocks() * self.block_size

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        """Every page is the null block, free, cached, or referenced exactly as often as
        tables hold it; the CPU pool likewise; (given token counts) each table has
        exactly the entries the sequence's slots need."""
        owners: Counter[int] = Counter({NULL_BLOCK: 1})
        for table in self._tables.values():
            owners.update(_live(table))
        self.pool.check_integrity(dict(owners))
        if self.cpu_pool is not None:
            cpu: Counter[int] = Counter({NULL_BLOCK: 1})
            for table in self._swapped.values():
                cpu.update(_live(table))
            self.cpu_pool.check_integrity(dict(cpu))
        assert not self._tables.keys() & self._swapped.keys(), "a sequence is in both pools"
        for seq_id, n in (num_tokens or {}).items():
            have = len(self.block_table(seq_id))
            assert have == self.entries_for(n), f"{seq_id}: {have} entries for {n} tokens"
        for seq_id, hashes in self._hashes.items():
            entries = len(self.block_table(seq_id)) + len(self.swapped_table(seq_id))
            assert len(hashes) <= entries, f"{seq_id}: hashes past its table"

    # -- helpers ---------------------------------------------------------------------------
    def _can_allocate(self, entries: Sequence[int]) -> bool:
        """Whether blocks for these table entries (of any groups) are free."""
        return self.pool.can_allocate(len(entries))

    def _allocate(self, entries: Sequence[int]) -> list[int]:
        """One new block per table entry, in order (the one pool serves every group)."""
        return self.pool.allocate(len(entries))

    def _first_needed(self, window: int | None, position: int) -> int:
        """The block of the first key a query at `position` sees through `window`."""
        if window is None:
            return 0
        return max(0, position - window + 1) // self.block_size

    def _leading_hits(self, chain: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(chain) and self.pool.lookup(chain[n]) is not None:
            n += 1
        return n

    def _serves(self, chain: Sequence[BlockHash], window: int, hits: int) -> bool:
        """Whether a windowed group's cached blocks cover what a hit of `hits` needs."""
        first = self._first_needed(window, hits * self.block_size)
        return all(self.pool.lookup(h) is not None for h in chain[first:hits])


def _needed_tokens(group, num_tokens: int, block_size: int) -> int:
    """The slots a sequence of `num_tokens` needs in one group's pages."""
    if group.kind is KVCacheGroupKind.RECURRENT:
        return min(num_tokens, block_size)
    if group.window is None:
        return num_tokens
    return min(num_tokens, group.window)


def _live(entries) -> list[int]:
    return [b for b in entries if b != NULL_BLOCK]


def _pairs(src: Sequence[int], dst: Sequence[int]) -> list[BlockCopy]:
    return [(s, d) for s, d in zip(src, dst, strict=True) if s != NULL_BLOCK]
