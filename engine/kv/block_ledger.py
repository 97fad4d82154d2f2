"""The scheduler's replica of the block manager's tables, and the log of its changes."""

from __future__ import annotations

from typing import Unpack

from engine.kv.block_ops import (
    CACHE,
    COW,
    FORK,
    FREE,
    GROW,
    MATCH,
    RESET,
    SLIDE,
    SWAP_IN,
    SWAP_OUT,
    TRIM,
)
from engine.kv.block_tables import BlockCopy
from engine.kv.hybrid_kv_cache_manager import HybridKVCacheManager
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv.kv_cache_manager import KVCacheManager, TableOptions
from engine.kv.prefix_hash import BlockHash
from engine.messages import ApplyBlockOps, BlockOp, BlockOpsApplied


class BlockLedgerError(RuntimeError):
    """The block manager's account disagrees with the replica (a bug, never load)."""


class BlockLedger(KVCacheManager):
    """A `KVCacheManager` inside the scheduler that logs every change it makes.

    The scheduler plans on it exactly as on local tables: block ids, prefix hits and
    copies are known at once. Every change is also a `BlockOp` (engine/kv/block_ops.py);
    `take_traffic()` packs the ops since the last exchange into ONE `ApplyBlockOps` for
    the block manager, which replays them on its own tables and answers with the block
    ids they produced; `apply(reply)` raises BlockLedgerError unless those ids and the
    free and cached block counts are the replica's own at `take_traffic()` time. So the
    answer is an audit that may come any time later (the ledger goes on planning
    meanwhile), but one exchange is open at a time: `take_traffic()` raises while the
    last answer is unchecked.
    """

    def __init__(self, num_blocks: int, block_size: int, **options: Unpack[TableOptions]) -> None:
        super().__init__(num_blocks, block_size, **options)
        self._ops: list[BlockOp] = []
        self._block_ids: list[int] = []  # ids the logged ops put into tables
        self._exchanges = 0
        self._awaited: tuple[int, tuple[int, ...], int, int] | None = None

    # -- the logged changes ----------------------------------------------------------
    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        table = self._tables.get(seq_id)
        before = len(table) if table else 0
        if self.entries_for(num_tokens) <= before:
            return table if table is not None else []  # decode step: room in the last block
        table = super().grow(seq_id, num_tokens)
        if table is not None:
            self._ops.append(BlockOp(GROW, seq_id, num_tokens))
            self._block_ids += table[before:]
        return table

    def slide(self, seq_id: str, num_computed: int) -> int:
        freed = super().slide(seq_id, num_computed)
        if freed:
            self._ops.append(BlockOp(SLIDE, seq_id, num_computed))
        return freed

    def trim(self, seq_id: str, num_tokens: int) -> int:
        def sizes() -> tuple[int, int, int]:
            hashes = len(self._hashes.get(seq_id, ()))
            return len(self.block_table(seq_id)), len(self.swapped_table(seq_id)), hashes

        before = sizes()
        freed = super().trim(seq_id, num_tokens)
        if before != sizes():
            self._ops.append(BlockOp(TRIM, seq_id, num_tokens))
        return freed

    def free(self, seq_id: str) -> None:
        if seq_id in self._tables or seq_id in self._swapped:
            super().free(seq_id)
            self._ops.append(BlockOp(FREE, seq_id))

    def swap_out(self, seq_id: str) -> list[BlockCopy] | None:
        copies = super().swap_out(seq_id)
        if copies is not None:
            self._ops.append(BlockOp(SWAP_OUT, seq_id))
            self._block_ids += [cpu for _, cpu in copies]
        return copies

    def swap_in(self, seq_id: str) -> list[BlockCopy] | None:
        copies = super().swap_in(seq_id)
        if copies is not None:
            self._ops.append(BlockOp(SWAP_IN, seq_id))
            self._block_ids += [dst for _, dst in copies]
        return copies

    def fork(self, parent_id: str, child_id: str, num_tokens: int = 0) -> list[int]:
        table = super().fork(parent_id, child_id, num_tokens)
        self._ops.append(BlockOp(FORK, child_id, num_tokens, parent_id))
        return table

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None:
        copies = super().copy_on_write(seq_id, start)
        if copies:
            self._ops.append(BlockOp(COW, seq_id, start))
            self._block_ids += [dst for _, dst in copies]
        return copies

    def adopt_prefix(self, seq_id: str, hashes: list[BlockHash]) -> list[int]:
        blocks = super().adopt_prefix(seq_id, hashes)
        self._ops.append(BlockOp(MATCH, seq_id, hashes=tuple(hashes)))
        self._block_ids += blocks
        return blocks

    def register_blocks(self, seq_id: str, first: int, hashes: list[BlockHash]) -> None:
        super().register_blocks(seq_id, first, hashes)
        self._ops.append(BlockOp(CACHE, seq_id, first, hashes=tuple(hashes)))

    def reset_prefix_cache(self) -> int:
        dropped = super().reset_prefix_cache()
        self._ops.append(BlockOp(RESET, ""))
        return dropped

    # -- the exchange ----------------------------------------------------------------
    @property
    def has_traffic(self) -> bool:
        return bool(self._ops)

    def take_traffic(self) -> ApplyBlockOps:
        """The ops since the last exchange, as one message; the log starts afresh."""
        if self._awaited is not None:
            raise BlockLedgerError(f"exchange {self._awaited[0]} is still unanswered")
        self._exchanges += 1
        message = ApplyBlockOps(self._exchanges, tuple(self._ops))
        self._awaited = (
            self._exchanges,
            tuple(self._block_ids),
            self.pool.num_free,
            self.pool.num_cached,
        )
        self._ops, self._block_ids = [], []
        return message

    def apply(self, reply: BlockOpsApplied) -> None:
        """Checks the block manager's account of the last exchange against the replica."""
        if self._awaited is None or reply.exchange_id != self._awaited[0]:
            raise BlockLedgerError(f"unexpected answer to exchange {reply.exchange_id}")
        _, block_ids, num_free, num_cached = self._awaited
        self._awaited = None
        if reply.error is not None:
            raise BlockLedgerError(f"exchange {reply.exchange_id}: {reply.error}")
        got = (reply.block_ids, reply.num_free_blocks, reply.num_cached_blocks)
        if got != (block_ids, num_free, num_cached):
            raise BlockLedgerError(
                f"exchange {reply.exchange_id}: the block manager has ids {list(got[0])}, "
                f"{got[1]} free, {got[2]} cached; the replica {list(block_ids)}, "
                f"{num_free} free, {num_cached} cached"
            )

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        assert not self.has_traffic, "traffic not yet exchanged"
        super().check_integrity(num_tokens)


class HybridBlockLedger(BlockLedger, HybridKVCacheManager):
    """A `BlockLedger` over the hybrid allocator's tables (one per KV cache group,
    interleaved): the same logged changes, replayed by a block manager whose tables are
    a `HybridKVCacheManager` of the same layout."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        layout: KVCacheLayout,
        **options: Unpack[TableOptions],
    ) -> None:
        super().__init__(num_blocks, block_size, layout=layout, **options)
