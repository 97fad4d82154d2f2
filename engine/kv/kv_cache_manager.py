"""Block tables: which physical blocks hold each sequence's tokens, and which are shared."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TypedDict

from engine.kv.block_count import cdiv
from engine.kv.block_pool import BlockPool
from engine.kv.block_tables import BlockCopy
from engine.kv.prefix_hash import BlockHash, TokenSlice, chain_hashes


class TableOptions(TypedDict, total=False):
    """`KVCacheManager`'s keyword settings, as the classes built on it pass them on."""

    enable_prefix_caching: bool
    extra_key: int
    num_cpu_blocks: int


class KVCacheManager:
    """Owns every sequence's block table; allocates, shares and caches blocks (the paged
    `BlockTables`).

    The primitives every decoding algorithm is built from:
    - `grow(seq_id, num_tokens)`: the table holds `num_tokens` tokens (all or nothing;
      None when blocks run out). A table never holds a block beyond what its tokens
      need, so waste per sequence stays below one block.
    - `fork(parent, child)`: the child's table is the parent's, every block shared.
    - `copy_on_write(seq_id, start)`: before a step writes positions >= `start`, every
      shared block it would write is replaced by a private copy; the (src, dst) pairs are
      for the worker to copy, all of a step in one batched operation.
    - `trim(seq_id, num_tokens)`: the table shrinks back to `num_tokens` tokens (draft
      tokens' slots released once verification rejected them).
    - `free(seq_id)`: one owner fewer for each block of the table.
    - `swap_out(seq_id)` / `swap_in(seq_id)`: the table moves to CPU swap blocks and
      back (preemption by swapping), with the block copies to make.

    With prefix caching, full computed blocks are registered under their prefix hash
    (`cache_computed`), and a new sequence's table starts with every cached block its
    tokens match (`match_prefix`), so those tokens are not computed again.
    """

    num_groups = 1  # block tables per sequence (HybridKVCacheManager: one per KV cache group)
    has_windows = False  # whether `slide` can free anything

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        extra_key: int = 0,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self._swapped: dict[str, list[int]] = {}  # seq_id -> its CPU blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of the leading full blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks some table holds (cached blocks no table holds are not counted)."""
        return self.pool.num_used

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def num_cache_evictions(self) -> int:
        return self.pool.num_evictions

    def blocks_for(self, num_tokens: int, num_computed: int = 0) -> int:
        """Blocks a table holding `num_tokens` slots takes (`num_computed` matters
        only to sliding windows)."""
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds while it is computed
        from its start in chunks of at most `max_chunk` tokens (a readmitted one
        recomputing): all of them, here."""
        return cdiv(num_tokens, self.block_size)

    def entries_for(self, num_tokens: int) -> int:
        """The length of a table holding `num_tokens` slots."""
        return cdiv(num_tokens, self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    # -- the primitives ------------------------------------------------------------------
    def slide(self, seq_id: str, num_computed: int) -> int:
        """Frees the blocks no query from position `num_computed` on can see (only
        sliding windows have such); how many. Full attention: nothing."""
        return 0

    def sees_context(self, seq_id: str, position: int) -> bool:
        """Whether the table still holds every block a query at `position` reads (a
        sliding window may have let older ones go). Full attention: always."""
        return True

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Grows the table to hold `num_tokens` tokens; the live table (None: blocks ran
        out, nothing changed)."""
        table = self._tables.get(seq_id)
        need = cdiv(num_tokens, self.block_size) - (len(table) if table else 0)
        if need <= 0:
            return table if table is not None else []
        if not self.pool.can_allocate(need):
            return None
        if table is None:
            table = self._tables[seq_id] = []
        table.extend(self.pool.allocate(need))
        return table

    def fork(self, parent_id: str, child_id: str, num_tokens: int = 0) -> list[int]:
        """A new sequence sharing the blocks of `parent_id` (ref counts up): those holding
        its first `num_tokens` tokens, or all of them when `num_tokens` is 0."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = self.block_table(parent_id)
        if num_tokens:
            if self.blocks_for(num_tokens) > len(table):
                raise ValueError(f"{parent_id!r} holds fewer than {num_tokens} tokens")
            table = table[: self.blocks_for(num_tokens)]
        table = list(table)
        self.pool.fork(table)
        self._tables[child_id] = table
        hashes = self._hashes.get(parent_id, [])
        self._hashes[child_id] = (
            hashes[: num_tokens // self.block_size] if num_tokens else hashes[:]
        )
        return table

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None:
        """Gives `seq_id` private copies of the shared blocks holding positions >= `start`;
        the copies to make, or None (nothing changed) when blocks run out."""
        table = self._tables.get(seq_id)
        if not table:
            return []
        ref = self.pool.ref_count
        shared = [i for i in range(start // self.block_size, len(table)) if ref(table[i]) > 1]
        if not self.pool.can_allocate(len(shared)):
            return None
        copies = []
        for i, dst in zip(shared, self.pool.allocate(len(shared)), strict=True):
            src = table[i]
            self.pool.free([src])  # still owned by the other tables
            table[i] = dst
            copies.append((src, dst))
        return copies

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """The table (on the device, or swapped out) keeps only the blocks its first
        `num_tokens` tokens need; the rest (slots a step reserved for draft tokens that
        verification rejected) go back to their pool, tail first, and no prefix hash
        outlives the full blocks kept. Returns the blocks freed."""
        table, release = self._tables.get(seq_id), self._release
        if not table:  # a swapped-out table gives back swap space
            table, release = self._swapped.get(seq_id), self._release_swapped
        if not table:
            return 0
        keep = self.entries_for(num_tokens)
        freed = table[keep:]
        if freed:
            release(freed)
            del table[keep:]
        hashes = self._hashes.get(seq_id)
        if hashes:
            del hashes[num_tokens // self.block_size * self.num_groups :]
        return len(freed)

    def _release(self, entries: list[int]) -> None:
        """Table entries back to the pool, tail first."""
        self.pool.free(reversed(entries))

    def _release_swapped(self, entries: list[int]) -> None:
        """Swapped-out table entries back to the swap space."""
        self.cpu_pool.free(entries)

    def free(self, seq_id: str) -> None:
        """Drops the table (or the swapped-out one). Its tail blocks go first, so under
        memory pressure a cached prefix's later blocks are evicted before its earlier
        (more shared) ones."""
        table = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if table:
            self._release(table)
        swapped = self._swapped.pop(seq_id, None)
        if swapped:
            self.cpu_pool.free(swapped)

    # -- swapping ----------------------------------------------------------------------
    @property
    def num_swapped_blocks(self) -> int:
        return self.cpu_pool.num_used if self.cpu_pool else 0

    def swap_out(self, seq_id: str) -> list[BlockCopy] | None:
        """Moves the table to CPU blocks (all or nothing; None when the swap space is
        short); the (device, CPU) copies to make before the device blocks are reused."""
        table = self._tables.get(seq_id)
        if not table or self.cpu_pool is None or not self.cpu_pool.can_allocate(len(table)):
            return None
        cpu = self.cpu_pool.allocate(len(table))
        copies = list(zip(table, cpu, strict=True))
        del self._tables[seq_id]
        self.pool.free(reversed(table))
        self._swapped[seq_id] = cpu
        return copies

    def swap_in(self, seq_id: str) -> list[BlockCopy] | None:
        """Brings a swapped-out table back onto new device blocks (all or nothing; None
        when they are short); the (CPU, device) copies to make. Its cached prefix is
        registered again."""
        cpu = self._swapped.get(seq_id)
        if cpu is None or not self.pool.can_allocate(len(cpu)):
            return None
        table = self.pool.allocate(len(cpu))
        del self._swapped[seq_id]
        self.cpu_pool.free(cpu)
        self._tables[seq_id] = table
        for block, h in zip(table, self._hashes.get(seq_id, ()), strict=False):
            self.pool.cache(block, h)
        return list(zip(cpu, table, strict=True))

    def swapped_table(self, seq_id: str) -> list[int]:
        return self._swapped.get(seq_id, [])

    # -- the prefix cache ------------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Starts the (empty) table of `seq_id` with the cached blocks matching the start
        of `token_ids`; returns how many tokens they hold. The block holding the last
        token is never matched: its logits must be computed. `free(seq_id)` undoes it."""
        if not self.enable_prefix_caching or seq_id in self._tables:
            return 0
        bs = self.block_size
        end = (len(token_ids) - 1) // bs
        hashes = chain_hashes(None, lambda a, b: token_ids[a:b], 0, end, bs, self.extra_key)
        lookup = self.pool.lookup
        num_hits = 0
        while num_hits < len(hashes) and lookup(hashes[num_hits]) is not None:
            num_hits += 1
        if num_hits:
            self.adopt_prefix(seq_id, hashes[:num_hits])
        return num_hits * self.block_size

    def adopt_prefix(self, seq_id: str, hashes: list[BlockHash]) -> list[int]:
        """Starts the empty table of `seq_id` with the cached blocks of `hashes` (all must
        be cached); returns them."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        blocks = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                raise ValueError(f"prefix hash {h} is not cached")
            blocks.append(block)
        self.pool.touch(blocks)
        self._tables[seq_id] = blocks
        self._hashes[seq_id] = list(hashes)
        return list(blocks)

    def cache_computed(self, seq_id: str, tokens: TokenSlice, num_computed: int) -> None:
        """Registers the blocks of `seq_id` that its first `num_computed` tokens (computed:
        their KV is in the cache; `tokens(start, end)` gives their ids) have filled since
        the last call."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id)
        if not table:
            return
        hashes = self._hashes.get(seq_id)
        done = len(hashes) if hashes else 0
        end = min(num_computed // self.block_size, len(table))
        if end <= done:
            return  # no block filled since the last call
        parent = hashes[-1] if done else None
        new = chain_hashes(parent, tokens, done, end, self.block_size, self.extra_key)
        self.register_blocks(seq_id, done, new)

    def register_blocks(self, seq_id: str, first: int, hashes: list[BlockHash]) -> None:
        """Caches blocks first, first+1, ... of `seq_id` under `hashes` (the next links of
        its chain). A block whose prefix another block already holds stays uncached."""
        table = self._tables[seq_id]
        chain = self._hashes.setdefault(seq_id, [])
        if len(chain) != first or first + len(hashes) > len(table):
            raise ValueError(
                f"{seq_id!r}: blocks {first}..{first + len(hashes) - 1} do not follow its "
                f"{len(chain)} hashed blocks within its {len(table)}"
            )
        for i, h in enumerate(hashes, first):
            self.pool.cache(table[i], h)
        chain.extend(hashes)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix; returns how many blocks were dropped from it."""
        return self.pool.reset_prefix_cache()

    # -- accounting ---------------------------------------------------------------------------
    def needed_slots(self, num_tokens: int) -> int:
        """Slots holding K/V a sequence of `num_tokens` computed tokens still needs."""
        return num_tokens

    def num_allocated_slots(self) -> int:
        return sum(len(t) for t in self._tables.values()) * self.block_size

    def num_table_blocks(self) -> int:
        """Blocks the tables would hold with no sharing at all."""
        return sum(len(t) for t in self._tables.values())

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        """Every block is free, cached, or referenced exactly as many times as block
        tables hold it, and (given each sequence's stored token count) every table is
        exactly as long as it needs."""
        owners: Counter[int] = Counter()
        for table in self._tables.values():
            owners.update(table)
        self.pool.check_integrity(dict(owners))
        if self.cpu_pool is not None:
            cpu_owners: Counter[int] = Counter()
            for blocks in self._swapped.values():
                cpu_owners.update(blocks)
            self.cpu_pool.check_integrity(dict(cpu_owners))
        assert not self._tables.keys() & self._swapped.keys(), "a sequence is in both pools"
        for seq_id, n in (num_tokens or {}).items():
            have = len(self.block_table(seq_id))
            assert have == self.blocks_for(n), f"{seq_id}: {have} blocks for {n} tokens"
        for seq_id, hashes in self._hashes.items():
            blocks = len(self.block_table(seq_id)) + len(self.swapped_table(seq_id))
            assert len(hashes) <= blocks, f"{seq_id}: hashes past its table"
