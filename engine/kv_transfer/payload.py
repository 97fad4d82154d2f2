"""The wire form of a run of KV blocks: a header, then raw bytes (torch-free).

The bytes are one C-order array `[num_blocks, num_layers, 2, *block_shape]` of `dtype`
(2: key, then value): every layer's K and V of a block lie together, so a run of the
blocks is a run of the bytes. `block_shape` is the canonical one, `[block_size,
num_kv_heads, head_size]` (head_size + 4 for an 8-bit cache's rows), whatever layout each
side's cache keeps (`engine.kv_transfer.blocks.KVLayout`), so a producer and a consumer
on different attention backends still agree.

A payload may also carry the final hidden state at its prompt's last position
(`hidden`, `hidden_size` elements of `hidden_dtype`, after the model's last norm): from
it a decode instance samples the first token without computing that position again.
"""

from __future__ import annotations

import dataclasses
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
    each `block_shape` elements of `dtype` (a torch dtype's name), `num_bytes` in all;
    then a hidden state of `hidden_size` elements of `hidden_dtype` (0: none). Field
    order is the wire format."""

    num_layers: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    num_bytes: int
    hidden_size: int = 0
    hidden_dtype: str = "float32"

    def __post_init__(self) -> None:
        for key in ("dtype", "hidden_dtype"):
            if getattr(self, key) not in ITEM_BYTES:
                raise ValueError(
                    f"blocks header: {key} must be one of {sorted(ITEM_BYTES)}; "
                    f"got {getattr(self, key)!r}"
                )
        for key in ("num_layers", "num_blocks", "num_bytes", "hidden_size"):
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
    def hidden_bytes(self) -> int:
        """Bytes of the hidden state (0: the payload carries none)."""
        return self.hidden_size * ITEM_BYTES[self.hidden_dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        """The bytes as an array: `[num_blocks, num_layers, 2, *block_shape]`."""
        return (self.num_blocks, self.num_layers, 2, *self.block_shape)


@dataclass(frozen=True)
class KVPayload:
    """A header, its blocks' bytes and its hidden state's bytes (read-only views;
    lengths checked against the header)."""

    header: BlocksHeader
    data: memoryview
    hidden: memoryview = memoryview(b"")

    def __post_init__(self) -> None:
        h = self.header
        for key, what, size in (
            ("data", "blocks", h.num_bytes),
            ("hidden", "hidden state", h.hidden_bytes),
        ):
            view = getattr(self, key)
            view = view if isinstance(view, memoryview) else memoryview(view)
            if view.nbytes != size:
                raise ValueError(
                    f"KV payload has {view.nbytes} bytes of {what}; its header says {size}"
                )
            object.__setattr__(self, key, view.cast("B").toreadonly())


def select_blocks(payload: KVPayload, indices: Sequence[int]) -> KVPayload:
    """The blocks at `indices` (positions in `payload`, in the order given). A run of
    consecutive positions is a view of the same bytes; other selections are copied."""
    h = payload.header
    bad = [i for i in indices if type(i) is not int or not 0 <= i < h.num_blocks]
    if bad:
        raise ValueError(f"block positions {bad} are out of range: the payload has {h.num_blocks}")
    size = h.block_bytes
    header = dataclasses.replace(h, num_blocks=len(indices), num_bytes=len(indices) * size)
    first = indices[0] if indices else 0
    if list(indices) == list(range(first, first + len(indices))):
        data = payload.data[first * size : first * size + header.num_bytes]
    else:
        data = memoryview(b"".join(payload.data[i * size : (i + 1) * size] for i in indices))
    return KVPayload(header, data, payload.hidden)
