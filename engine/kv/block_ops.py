"""Block ops: the changes to block tables that the block manager replays.

The scheduler's replica (`BlockLedger`) makes every change first and logs it as a
`BlockOp`; the block manager applies the same ops in the same order to its own
`KVCacheManager` with `apply_op`. Both start from the same state and every operation is
deterministic, so both give out the same block ids; each side lists the ids an op put
into a table, and the scheduler compares the lists.

| kind    | change                                                        | ids listed       |
|---------|---------------------------------------------------------------|------------------|
| `grow`  | `seq_id`'s table holds `num` tokens                           | the new blocks   |
| `free`  | `seq_id`'s table is dropped                                   | none             |
| `fork`  | `seq_id` shares `parent_id`'s blocks (of `num` tokens; 0: all) | none            |
| `cow`   | `seq_id`'s shared blocks at positions >= `num` become copies  | the copies       |
| `match` | `seq_id`'s empty table starts with the cached blocks `hashes` | the cached blocks|
| `cache` | `seq_id`'s blocks from index `num` are cached under `hashes`  | none             |
| `reset` | every cached prefix is forgotten                              | none             |
| `swap_out` | `seq_id`'s table moves to CPU swap blocks                  | the CPU blocks   |
| `swap_in`  | `seq_id`'s swapped table moves back to device blocks       | the device blocks|
| `slide` | `seq_id`'s windowed groups free what queries from `num` on cannot see | none |
| `trim`  | `seq_id`'s table shrinks to what `num` tokens need (rejected drafts) | none |
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kv.kv_cache_manager import KVCacheManager
from engine.messages import BlockOp, BlockOpKind

GROW, FREE, FORK, COW, MATCH, CACHE, RESET = (
    BlockOpKind.GROW,
    BlockOpKind.FREE,
    BlockOpKind.FORK,
    BlockOpKind.COW,
    BlockOpKind.MATCH,
    BlockOpKind.CACHE,
    BlockOpKind.RESET,
)
SWAP_OUT, SWAP_IN, SLIDE = BlockOpKind.SWAP_OUT, BlockOpKind.SWAP_IN, BlockOpKind.SLIDE
TRIM = BlockOpKind.TRIM


class BlockOpError(RuntimeError):
    """An op the block manager's tables cannot take: the replicas have diverged."""


def _grow(kv: KVCacheManager, op: BlockOp) -> list[int]:
    before = len(kv.block_table(op.seq_id))
    table = kv.grow(op.seq_id, op.num)
    if table is None:
        raise BlockOpError(f"no room to grow {op.seq_id!r} to {op.num} tokens")
    return table[before:]


def _slide(kv: KVCacheManager, op: BlockOp) -> list[int]:
    if not kv.slide(op.seq_id, op.num):
        raise BlockOpError(f"{op.seq_id!r} has nothing to slide out at {op.num} tokens")
    return []


def _trim(kv: KVCacheManager, op: BlockOp) -> list[int]:
    kv.trim(op.seq_id, op.num)
    return []


def _free(kv: KVCacheManager, op: BlockOp) -> list[int]:
    kv.free(op.seq_id)
    return []


def _fork(kv: KVCacheManager, op: BlockOp) -> list[int]:
    kv.fork(op.parent_id, op.seq_id, op.num)
    return []


def _cow(kv: KVCacheManager, op: BlockOp) -> list[int]:
    copies = kv.copy_on_write(op.seq_id, op.num)
    if copies is None:
        raise BlockOpError(f"no room to copy the shared blocks of {op.seq_id!r}")
    return [dst for _, dst in copies]


def _match(kv: KVCacheManager, op: BlockOp) -> list[int]:
    return kv.adopt_prefix(op.seq_id, list(op.hashes))


def _cache(kv: KVCacheManager, op: BlockOp) -> list[int]:
    kv.register_blocks(op.seq_id, op.num, list(op.hashes))
    return []


def _reset(kv: KVCacheManager, op: BlockOp) -> list[int]:
    kv.reset_prefix_cache()
    return []


def _swap_out(kv: KVCacheManager, op: BlockOp) -> list[int]:
    copies = kv.swap_out(op.seq_id)
    if copies is None:
        raise BlockOpError(f"no swap space for {op.seq_id!r}")
    return [cpu for _, cpu in copies]


def _swap_in(kv: KVCacheManager, op: BlockOp) -> list[int]:
    copies = kv.swap_in(op.seq_id)
    if copies is None:
        raise BlockOpError(f"no room to swap {op.seq_id!r} back in")
    return [dst for _, dst in copies]


_APPLY: dict[str, Callable[[KVCacheManager, BlockOp], list[int]]] = {
    GROW: _grow,
    FREE: _free,
    FORK: _fork,
    COW: _cow,
    MATCH: _match,
    CACHE: _cache,
    RESET: _reset,
    SWAP_OUT: _swap_out,
    SWAP_IN: _swap_in,
    SLIDE: _slide,
    TRIM: _trim,
}


def apply_op(kv: KVCacheManager, op: BlockOp) -> list[int]:
    """Applies `op` to `kv`; returns the block ids it put into a table. Raises
    BlockOpError when the op does not fit these tables."""
    apply = _APPLY.get(op.kind)
    if apply is None:
        raise BlockOpError(f"unknown block op {op.kind!r}; expected one of {sorted(_APPLY)}")
    try:
        return apply(kv, op)
    except (ValueError, KeyError) as exc:
        raise BlockOpError(f"{op.kind} {op.seq_id!r}: {exc}") from None
