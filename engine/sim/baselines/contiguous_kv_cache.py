"""The paper's Orca baselines: one contiguous KV region per request, reserved up front."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.block_count import cdiv
from engine.kv.block_tables import BlockCopy
from engine.sim.baselines.buddy_allocator import BuddyAllocator
from engine.sim.baselines.reservation import ReservationPolicy, reservation_tokens
from engine.sim.memory_shares import KVMemoryShares


@dataclass
class _Region:
    """One sequence's run of consecutive blocks and how much of it its table shows."""

    start: int  # first block id of the buddy run
    run_blocks: int  # blocks the buddy allocator handed out (a power of two)
    reservation: int  # token slots the policy reserved
    num_tokens: int = 0  # tokens the table holds (the largest grow so far)
    table: list[int] = field(default_factory=list)  # the first blocks of the run


@dataclass(frozen=True)
class _Fork:
    """A forked sequence whose copies of its parent's blocks are still to be made."""

    sources: list[int]  # the parent's blocks, in table order
    num_tokens: int  # tokens they hold


class ContiguousKVCacheManager:
    """Block tables the way Orca keeps them: each sequence reserves one contiguous run
    of blocks for everything it will ever store, placed by a buddy allocator, so
    internal (over-reservation) and external (rounding, unusable holes) fragmentation
    are real. `BlockTables` for recompute preemption and no prefix caching.

    - `expect(seq_id, prompt_len, output_len)` comes before the first `grow(seq_id, ...)`:
      the reservation (`policy`, see `ReservationPolicy`) depends on the true output length.
    - `grow(seq_id, num_tokens)`: the first grow reserves the whole region (None when no
      free run is large enough; nothing changes). Later grows within the reservation only
      lengthen the table: its first `blocks_for(num_tokens)` blocks, consecutive ids.
      Beyond the reservation: None (the Scheduler answers by preempting; a sequence
      whose true output outgrew its `expect` must be expected again, longer, before it
      is re-admitted, or it is preempted each time it reaches its reservation).
    - `free(seq_id)`: the run goes back to the buddy allocator and the table is dropped;
      the expected lengths stay (a preempted request is recomputed and grows again).
    - `fork(parent, child, num_tokens)`: nothing is shared; the child reserves its own
      region (its own `expect`, else its parent's) and its first `copy_on_write` returns
      a copy of every parent block it holds, whatever `start` is. If no run is free at
      fork time the child holds no blocks until a `copy_on_write` finds one (None until
      then). The copies read the parent's blocks as they were at the fork: make them
      before the parent is freed.

    Not supported (ValueError naming the setting): prefix caching
    (`enable_prefix_caching`) and swap preemption (`num_cpu_blocks`, `swap_out`,
    `swap_in`: use preemption_mode='recompute').
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: ReservationPolicy,
        max_model_len: int,
        *,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
    ) -> None:
        if enable_prefix_caching:
            raise ValueError(
                "ContiguousKVCacheManager does not support prefix caching: set "
                "enable_prefix_caching=False"
            )
        if num_cpu_blocks:
            raise ValueError(
                "ContiguousKVCacheManager does not support swap preemption: set "
                "num_cpu_blocks=0 (swap_space=0, preemption_mode='recompute')"
            )
        self.block_size = block_size
        self.policy = ReservationPolicy(policy)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = False
        self.buddy = BuddyAllocator(num_blocks)
        self._expected: dict[str, tuple[int, int]] = {}  # seq_id -> (prompt_len, output_len)
        self._regions: dict[str, _Region] = {}
        self._forks: dict[str, _Fork] = {}

    @property
    def num_blocks(self) -> int:
        return self.buddy.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in all; a reservation may still find no run large enough."""
        return self.buddy.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks of every run handed out (a reservation's unused rest included)."""
        return self.buddy.num_allocated

    @property
    def num_cached_blocks(self) -> int:
        return 0  # no prefix caching

    @property
    def num_cache_evictions(self) -> int:
        return 0

    num_groups = 1
    has_windows = False

    def blocks_for(self, num_tokens: int, num_computed: int = 0) -> int:
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def entries_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def slide(self, seq_id: str, num_computed: int) -> int:
        return 0  # a region holds every token of its sequence

    def needed_slots(self, num_tokens: int) -> int:
        return num_tokens

    def sees_context(self, seq_id: str, position: int) -> bool:
        return True

    def block_table(self, seq_id: str) -> list[int]:
        region = self._regions.get(seq_id)
        return region.table if region else []

    # -- request lengths -----------------------------------------------------------------
    def expect(self, seq_id: str, prompt_len: int, output_len: int) -> None:
        """Records the lengths the reservation is sized by (again after a `free`, to
        resize it)."""
        if seq_id in self._regions:
            raise ValueError(f"expect({seq_id!r}): it holds its region; free it first")
        reservation_tokens(self.policy, prompt_len, output_len, self.max_model_len)  # checks
        self._expected[seq_id] = (prompt_len, output_len)

    def reservation(self, seq_id: str) -> int:
        """Token slots the policy reserves for `seq_id`."""
        if seq_id not in self._expected:
            raise ValueError(f"reservation({seq_id!r}): call expect({seq_id!r}, ...) first")
        prompt_len, output_len = self._expected[seq_id]
        return reservation_tokens(self.policy, prompt_len, output_len, self.max_model_len)

    # -- the primitives ------------------------------------------------------------------
    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """The table holding `num_tokens` tokens, reserving the region on the first grow;
        None (nothing changed) when no run fits or the reservation is too small."""
        region = self._regions.get(seq_id)
        if region is None:
            if seq_id not in self._expected:
                raise ValueError(f"grow({seq_id!r}): call expect({seq_id!r}, ...) first")
            if num_tokens == 0:
                return []
            region = self._reserve(seq_id, num_tokens)
            if region is None:
                return None
        if num_tokens > region.reservation:
            return None
        if num_tokens > region.num_tokens:
            region.num_tokens = num_tokens
            table, need = region.table, self.blocks_for(num_tokens)
            table.extend(range(region.start + len(table), region.start + need))
        return region.table

    def fork(self, parent_id: str, child_id: str, num_tokens: int = 0) -> list[int]:
        """A new sequence holding a copy of the blocks of `parent_id` that hold its
        first `num_tokens` tokens (all when 0), in a region of its own ([] until one is
        free); `copy_on_write(child_id, ...)` gives the copies to make."""
        if child_id in self._regions or child_id in self._forks:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        parent = self._regions.get(parent_id)
        if parent is None:
            raise ValueError(f"fork: {parent_id!r} holds no blocks")
        num_tokens = num_tokens or parent.num_tokens
        if self.blocks_for(num_tokens) > len(parent.table):
            raise ValueError(f"{parent_id!r} holds fewer than {num_tokens} tokens")
        if child_id not in self._expected:
            self._expected[child_id] = self._expected[parent_id]
        sources = parent.table[: self.blocks_for(num_tokens)]
        self._forks[child_id] = _Fork(sources, num_tokens)
        self.grow(child_id, num_tokens)
        return self.block_table(child_id)

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None:
        """After a fork: (parent block, own block) for every block the fork copied, all of
        them (nothing is shared, so `start` does not narrow it); None (nothing changed)
        while no region is free for it; [] otherwise."""
        fork = self._forks.get(seq_id)
        if fork is None:
            return []
        table = self.grow(seq_id, fork.num_tokens)
        if table is None:
            return None
        del self._forks[seq_id]
        return list(zip(fork.sources, table[: len(fork.sources)], strict=True))

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """The table shows only the blocks of its first `num_tokens` tokens; the region
        (reserved for the whole sequence) keeps the rest, so no block is freed."""
        region = self._regions.get(seq_id)
        if region is None or num_tokens >= region.num_tokens:
            return 0
        region.num_tokens = num_tokens
        del region.table[self.blocks_for(num_tokens) :]
        return 0

    def free(self, seq_id: str) -> None:
        """Returns the region to the buddy allocator and drops the table."""
        self._forks.pop(seq_id, None)
        region = self._regions.pop(seq_id, None)
        if region is not None:
            self.buddy.free(region.start)

    def _reserve(self, seq_id: str, num_tokens: int) -> _Region | None:
        reservation = self.reservation(seq_id)
        if num_tokens > reservation:
            return None
        start = self.buddy.allocate(self.blocks_for(reservation))
        if start is None:
            return None
        region = _Region(start, self.buddy.run_size(start), reservation)
        self._regions[seq_id] = region
        return region

    # -- what it does not support ----------------------------------------------------------
    @property
    def num_swapped_blocks(self) -> int:
        return 0

    def swapped_table(self, seq_id: str) -> list[int]:
        return []

    def swap_out(self, seq_id: str) -> list[BlockCopy] | None:
        raise ValueError(_NO_SWAP)

    def swap_in(self, seq_id: str) -> list[BlockCopy] | None:
        raise ValueError(_NO_SWAP)

    def match_prefix(self, seq_id: str, token_ids: object) -> int:
        """No prefix caching: nothing is ever matched."""
        return 0

    def cache_computed(self, seq_id: str, tokens: object, num_computed: int) -> None:
        """No prefix caching: nothing is registered."""

    def reset_prefix_cache(self) -> int:
        return 0

    # -- accounting ---------------------------------------------------------------------------
    def num_allocated_slots(self) -> int:
        """Slots of every run the buddy allocator handed out (reserved and rounding too)."""
        return self.buddy.num_allocated * self.block_size

    def num_table_blocks(self) -> int:
        """Blocks the tables hold (the reserved rest of each run not counted)."""
        return sum(len(r.table) for r in self._regions.values())

    def memory_shares(self) -> KVMemoryShares:
        """Every slot in one share: token, reserved, internal, external or free."""
        token = reserved = internal = external = 0
        for seq_id, region in self._regions.items():
            prompt_len, output_len = self._expected[seq_id]
            need = min(prompt_len + output_len, region.reservation)
            token += region.num_tokens
            reserved += max(0, need - region.num_tokens)
            internal += region.reservation - max(need, region.num_tokens)
            external += region.run_blocks * self.block_size - region.reservation
        free = self.buddy.num_free * self.block_size
        return KVMemoryShares(token, reserved, internal, external, free)

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        """The buddy allocator is consistent; its allocated runs are exactly the regions;
        each table is the start of its run, as long as its tokens need, within the
        reservation; (given each sequence's stored token count) every table is exactly
        as long as it needs; the memory shares add up to the total."""
        self.buddy.check_integrity()
        runs = {r.start: r.run_blocks for r in self._regions.values()}
        assert runs == dict(self.buddy.allocated_runs()), "buddy runs differ from the regions"
        for seq_id, r in self._regions.items():
            assert r.num_tokens <= r.reservation, f"{seq_id}: tokens past its reservation"
            assert self.blocks_for(r.reservation) <= r.run_blocks, f"{seq_id}: run too short"
            want = list(range(r.start, r.start + self.blocks_for(r.num_tokens)))
            assert r.table == want, f"{seq_id}: table {r.table}, expected {want}"
            assert seq_id in self._expected, f"{seq_id}: a region without expected lengths"
        for seq_id, fork in self._forks.items():
            have = len(self.block_table(seq_id))
            assert have in (0, len(fork.sources)), f"{seq_id}: fork holds {have} blocks"
        for seq_id, n in (num_tokens or {}).items():
            have = len(self.block_table(seq_id))
            assert have == self.blocks_for(n), f"{seq_id}: {have} blocks for {n} tokens"
        shares = self.memory_shares()
        assert shares.total == self.num_blocks * self.block_size, f"shares {shares} != total"


_NO_SWAP = (
    "ContiguousKVCacheManager does not support swap preemption: use preemption_mode='recompute'"
)
