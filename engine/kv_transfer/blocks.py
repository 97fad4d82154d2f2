"""Copying KV blocks out of a paged cache into a payload, and from a payload into blocks.

`gather_blocks(kv_cache, block_ids, layout)` reads the blocks `block_ids` of every
layer's K and V cache into one `KVPayload`; `scatter_blocks(kv_cache, block_ids,
payload, layout)` writes a payload's blocks, in order, into `block_ids`. The contract:
scattering a gathered payload into fresh blocks of a cache of the same shape gives
byte-identical blocks; a payload whose layers, block count, block shape or dtype differ
from the cache's is refused with a ValueError naming each difference, never truncated
or reinterpreted.

A `KVLayout` says where a backend's cache tensor keeps each axis of the canonical
`[num_blocks, block_size, num_kv_heads, head_size]`; it is read off the backend's own
`kv_cache_shape` (`KVLayout.of(backend.kv_cache_shape)`): the house layout and CUDA's
(`TOKEN_MAJOR`), the native CPU kernels' head-major blocks, SDPA's heads-first tensor.
The payload is always canonical, so two backends exchange blocks.

`with_hidden(payload, hidden)` attaches a prompt's last hidden state (`[hidden_size]`);
`hidden_of(payload, device)` gives it back as a tensor (None when it carries none).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_transfer.payload import BlocksHeader, KVPayload

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key_cache, value_cache)
_PROBE = (2, 3, 5, 7)  # distinct sizes: num_blocks, block_size, num_kv_heads, head_size


@dataclass(frozen=True)
class KVLayout:
    """`axes[d]`: the canonical axis (0 blocks, 1 tokens, 2 KV heads, 3 head dim) that
    dimension d of a cache tensor holds."""

    axes: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        if sorted(self.axes) != [0, 1, 2, 3]:
            raise ValueError(f"a KV layout permutes the axes 0..3; got {self.axes}")

    @classmethod
    def of(cls, kv_cache_shape: Callable[[int, int, int, int], tuple[int, ...]]) -> KVLayout:
        """The layout of a backend's `kv_cache_shape(num_blocks, block_size,
        num_kv_heads, head_size)`."""
        shape = tuple(kv_cache_shape(*_PROBE))
        if sorted(shape) != sorted(_PROBE):
            raise ValueError(
                f"KV transfer moves caches whose tensors permute [num_blocks, block_size, "
                f"num_kv_heads, head_size]; this backend's kv_cache_shape{_PROBE} is {shape}"
            )
        return cls(tuple(_PROBE.index(size) for size in shape))

    @property
    def block_dim(self) -> int:
        """The tensor dimension that indexes blocks."""
        return self.axes.index(0)

    def block_shape(self, cache: torch.Tensor) -> tuple[int, int, int]:
        """One block's canonical shape `(block_size, num_kv_heads, head_size)`."""
        return tuple(cache.shape[self.axes.index(axis)] for axis in (1, 2, 3))

    def to_canonical(self, blocks: torch.Tensor) -> torch.Tensor:
        """Selected blocks in this layout -> `[n, block_size, num_kv_heads, head_size]`."""
        return blocks.permute(*(self.axes.index(axis) for axis in range(4)))

    def from_canonical(self, blocks: torch.Tensor) -> torch.Tensor:
        """`[n, block_size, num_kv_heads, head_size]` -> this layout (a view)."""
        return blocks.permute(*self.axes)


TOKEN_MAJOR = KVLayout((0, 1, 2, 3))  # the house layout (AttentionBackend.kv_cache_shape)


def gather_blocks(
    kv_cache: KVCache, block_ids: Sequence[int], layout: KVLayout = TOKEN_MAJOR
) -> KVPayload:
    """Every layer's K and V of `block_ids`, in that order, as one payload (on the CPU)."""
    sample = _check_cache(kv_cache, layout)
    ids = _block_index(block_ids, sample.shape[layout.block_dim], sample.device, unique=False)
    block_shape = layout.block_shape(sample)
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
    out = torch.empty((len(ids), len(kv_cache), 2, *block_shape), dtype=sample.dtype)
    for layer, pair in enumerate(kv_cache):
        for kv, cache in enumerate(pair):
            out[:, layer, kv].copy_(layout.to_canonical(cache.index_select(layout.block_dim, ids)))
    data = out.view(-1).view(torch.uint8).numpy()  # no copy; the array keeps `out` alive
    header = BlocksHeader(len(kv_cache), len(ids), block_shape, _dtype_name(sample), data.nbytes)
    return KVPayload(header, memoryview(data))


def scatter_blocks(
    kv_cache: KVCache, block_ids: Sequence[int], payload: KVPayload, layout: KVLayout = TOKEN_MAJOR
) -> None:
    """Writes the payload's blocks, in order, into `block_ids` of every layer's K and V."""
    sample = _check_cache(kv_cache, layout)
    ids = _block_index(block_ids, sample.shape[layout.block_dim], sample.device, unique=True)
    _check_fits(payload.header, len(kv_cache), len(ids), layout.block_shape(sample), sample)
    if not ids.numel():
        return
    with warnings.catch_warnings():  # a read-only buffer: the tensor is only read from
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload.data, dtype=torch.uint8)
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
    blocks = flat.view(sample.dtype).view(payload.header.shape).to(sample.device)
    for layer, pair in enumerate(kv_cache):
        for kv, cache in enumerate(pair):
            cache.index_copy_(layout.block_dim, ids, layout.from_canonical(blocks[:, layer, kv]))


def with_hidden(payload: KVPayload, hidden: torch.Tensor) -> KVPayload:
    """`payload` carrying `hidden` ([hidden_size], any device), copied to the CPU."""
    row = hidden.detach().reshape(-1).to("cpu", copy=True).contiguous()
    header = dataclasses.replace(
        payload.header, hidden_size=row.numel(), hidden_dtype=_dtype_name(row)
    )
    data = row.view(torch.uint8).numpy()  # no copy; the array keeps `row` alive
    return KVPayload(header, payload.data, memoryview(data))


def hidden_of(payload: KVPayload, device: torch.device | str) -> torch.Tensor | None:
    """The payload's hidden state, `[hidden_size]` on `device`; None if it has none."""
    h = payload.header
    if not h.hidden_size:
        return None
    with warnings.catch_warnings():  # a read-only buffer: copied before use
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload.hidden, dtype=torch.uint8)
    return flat.view(getattr(torch, h.hidden_dtype)).to(device, copy=True)


def _check_cache(kv_cache: KVCache, layout: KVLayout) -> torch.Tensor:
    """The first key cache, once every tensor is seen to match it."""
    if not kv_cache:
        raise ValueError("the KV cache has no layers")
    sample = kv_cache[0][0]
    tensors = [t for pair in kv_cache for t in pair]
    if len({id(t) for t in tensors}) < len(tensors):
        raise ValueError(
            "layers of this KV cache share tensors (a hybrid layout): KV transfer moves one "
            "block table for every layer and does not move hybrid caches"
        )
    for t in tensors:
        if t.dim() != 4 or t.shape != sample.shape or t.dtype != sample.dtype:
            raise ValueError(
                f"every layer's K and V cache must be one 4-D shape and dtype; got "
                f"{tuple(t.shape)} {t.dtype} beside {tuple(sample.shape)} {sample.dtype}"
            )
    return sample


def _block_index(
    block_ids: Sequence[int], num_blocks: int, device: torch.device, unique: bool
) -> torch.Tensor:
    bad = [b for b in block_ids if type(b) is not int or not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} are out of range: this cache has {num_blocks} blocks")
    if unique and len(set(block_ids)) < len(block_ids):
        raise ValueError(f"block ids {list(block_ids)} repeat a block: each is written once")
    return torch.tensor(list(block_ids), dtype=torch.int64, device=device)  # [n]


def _check_fits(
    header: BlocksHeader, num_layers: int, num_blocks: int, block_shape: tuple, sample: torch.Tensor
) -> None:
    ours = {
        "layers": num_layers,
        "blocks": num_blocks,
        "block shape [block_size, num_kv_heads, head_size]": block_shape,
        "dtype": _dtype_name(sample),
    }
    theirs = {
        "layers": header.num_layers,
        "blocks": header.num_blocks,
        "block shape [block_size, num_kv_heads, head_size]": header.block_shape,
        "dtype": header.dtype,
    }
    differ = [f"{k}: payload {theirs[k]}, cache {ours[k]}" for k in ours if theirs[k] != ours[k]]
    if differ:
        raise ValueError(
            "KV payload does not fit these blocks (" + "; ".join(differ) + "); both instances "
            "must run the same model, block_size, kv_cache_dtype and tensor-parallel size, "
            "and the decode side allocate one block per block sent"
        )


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
