"""The scheduler's mirror of the block manager: counts blocks now, learns their ids later."""

from __future__ import annotations

from engine.messages import BlockReservation, BlocksReserved, ReserveBlocks

PENDING_BLOCK = -1


class BlockLedgerError(RuntimeError):
    """The block manager's answer disagrees with the ledger (a bug, never load)."""


class BlockLedger:
    """Stands in for a `KVCacheManager` inside the scheduler when the blocks live in a
    block manager actor.

    It offers the same calls the scheduler makes (`grow`, `allocate_slots`, `free`,
    `block_table`, `num_free_blocks`) and makes the same decisions, because it does the
    same arithmetic on block counts; but a new block shows up as `PENDING_BLOCK` until the
    block manager names it. Everything that changed since the last exchange is that
    exchange's traffic: `take_traffic()` packs it into ONE `ReserveBlocks` (frees, then
    the latest reservation per sequence), `apply(reply)` fills the pending ids in.

    The block manager runs the frees before the reservations, so at every reservation it
    has at least as many free blocks as the ledger had when it decided: it never refuses
    what the ledger granted, and after the exchange both count the same free blocks.
    `apply` checks both and raises `BlockLedgerError` if not.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}
        self._num_used = 0
        self._frees: list[str] = []  # sequences whose granted blocks must be freed
        self._reservations: dict[str, int] = {}  # seq_id -> tokens the table must hold
        self._exchanges = 0

    # -- what the scheduler calls (KVCacheManager's interface) ------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._num_used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def allocate_slots(self, seq_id: str, num_tokens: int) -> bool:
        return self.grow(seq_id, num_tokens) is not None

    # The prefix cache is not mirrored yet: the actor engine computes every prompt.
    enable_prefix_caching = False

    def match_prefix(self, seq_id: str, token_ids) -> int:
        return 0

    def cache_computed(self, seq_id: str, tokens, num_computed: int) -> None:
        pass

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """`allocate_slots` returning the live table (None: blocks ran out, no change)."""
        table = self._tables.get(seq_id)
        need = -(-num_tokens // self.block_size) - (0 if table is None else len(table))
        if need <= 0:
            return [] if table is None else table  # decode step: room in the last block
        if need > self.num_blocks - self._num_used:
            return None
        if table is None:
            table = self._tables[seq_id] = []
        table.extend([PENDING_BLOCK] * need)
        self._num_used += need
        self._reservations[seq_id] = num_tokens
        return table

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if not table:
            return
        self._num_used -= len(table)
        self._reservations.pop(seq_id, None)  # never sent: nothing to undo over there
        if table[0] != PENDING_BLOCK:  # the block manager holds some of its blocks
            self._frees.append(seq_id)

    # -- the exchange ----------------------------------------------------------------
    @property
    def has_traffic(self) -> bool:
        return bool(self._frees or self._reservations)

    def take_traffic(self) -> ReserveBlocks:
        """The traffic since the last exchange, as one message; the ledger starts afresh."""
        self._exchanges += 1
        message = ReserveBlocks(
            self._exchanges,
            tuple(self._frees),
            tuple(BlockReservation(s, n) for s, n in self._reservations.items()),
        )
        self._frees, self._reservations = [], {}
        return message

    def apply(self, reply: BlocksReserved) -> None:
        """Fills in the block ids `reply` granted; raises BlockLedgerError on disagreement."""
        if reply.refused_seq_ids:
            raise BlockLedgerError(
                f"exchange {reply.step_id}: the block manager refused {list(reply.refused_seq_ids)}"
            )
        for grant in reply.grants:
            table = self._tables.get(grant.seq_id, [])
            n = len(grant.block_ids)
            if n > len(table) or any(b != PENDING_BLOCK for b in table[-n:]):
                raise BlockLedgerError(
                    f"exchange {reply.step_id}: {n} blocks granted to {grant.seq_id!r}, "
                    f"which awaits {table.count(PENDING_BLOCK)}"
                )
            table[-n:] = grant.block_ids
        if reply.num_free_blocks != self.num_free_blocks:
            raise BlockLedgerError(
                f"exchange {reply.step_id}: block manager has {reply.num_free_blocks} free "
                f"blocks, the ledger counts {self.num_free_blocks}"
            )

    def check_integrity(self, num_tokens: dict[str, int] | None = None) -> None:
        """Every table is resolved, the used count adds up, and (given each sequence's
        stored token count) every table is exactly as long as it needs."""
        assert not self.has_traffic, "traffic not yet exchanged"
        assert self._num_used == sum(len(t) for t in self._tables.values()), "used count off"
        for seq_id, table in self._tables.items():
            assert PENDING_BLOCK not in table, f"{seq_id}: unresolved blocks {table}"
        for seq_id, n in (num_tokens or {}).items():
            have = len(self.block_table(seq_id))
            assert have == self.blocks_for(n), f"{seq_id}: {have} blocks for {n} tokens"
