"""`BlockTables`: what the scheduler and the engine core use of their block tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from engine.kv.prefix_hash import TokenSlice

BlockCopy = tuple[int, int]  # (source block id, destination block id)


@runtime_checkable
class BlockTables(Protocol):
    """Every sequence's block table, behind one interface: the paged tables
    (`KVCacheManager`), the scheduler's replica of a block manager's (`BlockLedger`),
    and the simulator's baselines (`ContiguousKVCacheManager`,
    `UnsharedKVCacheManager`, engine/sim/baselines/).

    Contract, per sequence id:
    - `grow(seq_id, num_tokens)`: the live table now holds `num_tokens` tokens (all or
      nothing: None, nothing changed, when blocks run out).
    - `slide(seq_id, num_computed)`: frees the blocks no query from position
      `num_computed` on can see (sliding-window groups; a no-op without them);
      `sees_context(seq_id, position)`: the table still holds what a query there reads
      (a fork starting further back than its parent slid may not share it).
    - `fork(parent_id, child_id, num_tokens)`: the child starts with the parent's blocks
      holding its first `num_tokens` tokens (all when 0), shared or copied.
    - `copy_on_write(seq_id, start)`: the (src, dst) copies that give `seq_id` private
      blocks for positions >= `start` before a step writes them (None: blocks ran out,
      nothing changed).
    - `trim(seq_id, num_tokens)`: the table shrinks to what its first `num_tokens`
      tokens need (the slots of rejected draft tokens); the blocks freed.
    - `free(seq_id)`: the table (or its swapped-out copy) is dropped.
    - `swap_out` / `swap_in`: the table moves to CPU swap blocks and back, with the
      copies to make (None: no room, nothing changed).
    - `match_prefix` / `cache_computed` / `reset_prefix_cache`: the prefix cache (tables
      without one match nothing and cache nothing).
    - `check_integrity(num_tokens)`: AssertionError unless every block is accounted for
      (and, given each sequence's stored token count, each table is as long as it needs).

    A table is one list of block ids. With several KV cache groups (the hybrid
    allocator, `num_groups` > 1) it interleaves the groups' tables by block position:
    entry `i * num_groups + g` is group g's block i; `entries_for(n)` is the length of
    a table of n slots, `blocks_for(n, computed)` the blocks it holds (fewer where a
    sliding window has let some go).

    The counts (`num_*`) are for planning and stats: `num_free_blocks` is what a `grow`
    may take, `num_allocated_slots()` the slots the tables hold, `needed_slots(n)` the
    slots a sequence of n computed tokens needs (fewer than n per group where a window
    lets go), `num_table_blocks()` the blocks they would hold with no sharing.
    """

    block_size: int
    enable_prefix_caching: bool
    num_groups: int
    has_windows: bool

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int: ...

    @property
    def num_cache_evictions(self) -> int: ...

    @property
    def num_swapped_blocks(self) -> int: ...

    def blocks_for(self, num_tokens: int, num_computed: int = 0) -> int: ...

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int: ...

    def entries_for(self, num_tokens: int) -> int: ...

    def slide(self, seq_id: str, num_computed: int) -> int: ...

    def sees_context(self, seq_id: str, position: int) -> bool: ...

    def block_table(self, seq_id: str) -> list[int]: ...

    def swapped_table(self, seq_id: str) -> list[int]: ...

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None: ...

    def fork(self, parent_id: str, child_id: str, num_tokens: int = 0) -> list[int]: ...

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None: ...

    def trim(self, seq_id: str, num_tokens: int) -> int: ...

    def free(self, seq_id: str) -> None: ...

    def swap_out(self, seq_id: str) -> list[BlockCopy] | None: ...

    def swap_in(self, seq_id: str) -> list[BlockCopy] | None: ...

    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int: ...

    def cache_computed(self, seq_id: str, tokens: TokenSlice, num_computed: int) -> None: ...

    def reset_prefix_cache(self) -> int: ...

    def needed_slots(self, num_tokens: int) -> int: ...

    def num_allocated_slots(self) -> int: ...

    def num_table_blocks(self) -> int: ...

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None: ...
