"""The wire form of a run of KV blocks: a header, then raw bytes (torch-free).

The bytes are one C-order array `[num_blocks, num_layers, 2, *block_shape]` of `dtype`
(2: key, then value): every layer's K and V of a block lie together, so a run of the
blocks is a run of the bytes. `block_shape` is the canonical one, `[block_size,
num_kv_heads, head_size]` (head_size + 4 for an 8-bit cache's rows), whatever layout each
side's cache keeps (`engine.kv_transfer.blocks.KVLayout`), so a producer and a consumer
on different attention backends still agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# torch dtypes a cache may hold, by name -> bytes per element
ITEM_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class BlocksHeader:
    """What the bytes after it hold: `num_blocks` blocks of `num_layers` layers' K and V,
    each `block_shape` elements of `dtype` (a torch dtype's name), `num_bytes` in all.
    Field order is the wire format."""

    num_layers: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    num_bytes: int

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_BYTES:
            raise ValueError(
                f"blocks header: dtype must be one of {sorted(ITEM_BYTES)}; got {self.dtype!r}"
            )
        for key in ("num_layers", "num_blocks", "num_bytes"):
            value = getattr(self, key)
            if type(value) is not int or value < 0:
                raise ValueError(f"blocks header: {key} must be an int >= 0; got {value!r}")
        if not self.block_shape or any(type(d) is not int or d < 1 for d in self.block_shape):
            raise ValueError(
                f"blocks header: block_shape must be dimensions >= 1; got {self.block_shape!r}"
            )
        if self.num_bytes != self.num_blocks * self.block_bytes:
            raise ValueError(
                f"blocks header: {self.num_blocks} blocks of {self.block_bytes} bytes are "
                f"{self.num_blocks * self.block_bytes} bytes, but num_bytes says {self.num_bytes}"
            )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's K and V."""
        return self.num_layers * 2 * math.prod(self.block_shape) * ITEM_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        """The bytes as an array: `[num_blocks, num_layers, 2, *block_shape]`."""
        return (self.num_blocks, self.num_layers, 2, *self.block_shape)


@dataclass(frozen=True)
class KVPayload:
    """A header and its bytes (a read-only view; length checked against the header)."""

    header: BlocksHeader
    data: memoryview

    def __post_init__(self) -> None:
        if not isinstance(self.data, memoryview):
            object.__setattr__(self, "data", memoryview(self.data))
        if self.data.nbytes != self.header.num_bytes:
            raise ValueError(
                f"KV payload has {self.data.nbytes} bytes; its header says {self.header.num_bytes}"
            )
        object.__setattr__(self, "data", self.data.cast("B").toreadonly())


def select_blocks(payload: KVPayload, indices: Sequence[int]) -> KVPayload:
    """The blocks at `indices` (positions in `payload`, in the order given). A run of
    consecutive positions is a view of the same bytes; other selections are copied."""
    h = payload.header
    bad = [i for i in indices if type(i) is not int or not 0 <= i < h.num_blocks]
    if bad:
        raise ValueError(f"block positions {bad} are out of range: the payload has {h.num_blocks}")
    size = h.block_bytes
    header = BlocksHeader(h.num_layers, len(indices), h.block_shape, h.dtype, len(indices) * size)
    first = indices[0] if indices else 0
    if list(indices) == list(range(first, first + len(indices))):
        return KVPayload(header, payload.data[first * size : first * size + header.num_bytes])
    data = b"".join(payload.data[i * size : (i + 1) * size] for i in indices)
    return KVPayload(header, memoryview(data))
