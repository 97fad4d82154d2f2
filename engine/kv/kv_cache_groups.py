"""KV cache groups: the layers of a model that share block tables, by layer kind.

A model whose layers all attend the same way has one group. A hybrid model (Gemma's
five local layers to one global, GPT-OSS's alternating windowed and full layers) has
one group per kind at least, because a sliding-window layer can free the blocks that
fall out of its window while a full-attention layer keeps every block. vLLM's hybrid
allocator, which this follows: every group draws block ids from ONE pool, so memory
moves between kinds as the load does, and every page (one block id) is the same size
in bytes. That holds because every group has the same number of layers,
`layers_per_group`: the kinds' layer lists are cut into chunks of that many layers,
and the KV cache holds `layers_per_group` tensors of `num_blocks` pages; layer
`groups[g].layers[j]` keeps its K/V in tensor j. Block id b given to group g is then
page b of every tensor j < len(groups[g].layers). A chunk shorter than
`layers_per_group` (the last of a kind) leaves its pages' other tensors unused: that
padding is the layout's only fixed waste (`padding_share` of page memory). A
full-attention group's pages grow with the context and a windowed group's stay bounded
by its window, so the chunk size is the one that pads full-attention groups least,
then pads least overall, among those giving at most `MAX_GROUPS` groups (fewer groups
on a tie). Gemma 3 27B's 52 local and 10 global layers: 13 groups of 5, the last local
one holding 2 (4.6% of page memory padding). vLLM cuts them into groups of the smallest
kind's size, 7 groups of 10 with the last local one holding 2 (11.4%), which on short
contexts, where windows free nothing, wastes more than keeping every layer's tokens.

A linear-attention (recurrent) layer keeps a fixed-size state per sequence instead of
K/V per token, in the pages of its group (engine/worker/recurrent_state.py): the page of
the block holding the sequence's last computed token holds the state after it, and a
full block's page the state at its end. So a RECURRENT group needs, of a sequence's
blocks, only those from the last computed token's on: in block arithmetic a window of
two tokens (`RECURRENT_WINDOW`), which the sliding-window machinery (sliding, prefix
hits that need only the blocks a window sees, swapping) then serves unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from engine.kv.block_count import cdiv

# Block tables per sequence at most: each costs a slot mapping per step and a table per
# sequence in the block manager (the simulator's bookkeeping for Gemma 3 27B: 1.7x with
# 13 groups instead of 7; still small beside the model's step).
MAX_GROUPS = 16
RECURRENT_WINDOW = 2  # a recurrent group keeps the last computed token's block and on


class KVCacheGroupKind(StrEnum):
    """How a group's layers use their blocks (the closed set of layer kinds)."""

    FULL_ATTENTION = "full_attention"  # every token's K/V, as long as the sequence lives
    SLIDING_WINDOW = "sliding_window"  # only the last `sliding_window` tokens' K/V
    RECURRENT = "recurrent"  # linear attention: a state per sequence, in its last block


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (model layer indices, ascending) that share one block table per sequence."""

    kind: KVCacheGroupKind
    layers: tuple[int, ...]
    sliding_window: int | None = None  # SLIDING_WINDOW only

    def __post_init__(self) -> None:
        windowed = self.kind is KVCacheGroupKind.SLIDING_WINDOW
        if windowed != (self.sliding_window is not None):
            raise ValueError(f"a {self.kind} group has sliding_window={self.sliding_window}")
        if not self.layers:
            raise ValueError("a KV cache group needs at least one layer")

    @property
    def window(self) -> int | None:
        """The tokens before the next query whose blocks this group keeps: None (all),
        the sliding window, or RECURRENT_WINDOW (the last computed token's block on)."""
        if self.kind is KVCacheGroupKind.RECURRENT:
            return RECURRENT_WINDOW
        return self.sliding_window

    def blocks_needed(self, num_computed: int, num_tokens: int, block_size: int) -> int:
        """Live blocks this group's table holds for a sequence with `num_tokens` slots
        of which `num_computed` are computed: all of them, or (windowed, recurrent)
        those from the block holding the first key (state) the next query needs."""
        if self.window is None:
            return cdiv(num_tokens, block_size)
        first = max(0, num_computed - self.window + 1) // block_size
        return cdiv(num_tokens, block_size) - min(first, cdiv(num_tokens, block_size))


@dataclass(frozen=True)
class KVCacheLayout:
    """A model's KV cache groups and the tensors they share (see the module docstring)."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_group: int

    @classmethod
    def from_windows(
        cls, windows: Sequence[int | None], recurrent_layers: Collection[int] = ()
    ) -> KVCacheLayout:
        """The layout for layers whose sliding windows are `windows` (None: full
        attention), one entry per layer; `recurrent_layers`: the linear-attention ones
        (their window entries are ignored)."""
        if not windows:
            raise ValueError("a model needs at least one layer")
        kinds: dict[int | str | None, list[int]] = {}
        for layer, window in enumerate(windows):
            key = KVCacheGroupKind.RECURRENT.value if layer in recurrent_layers else window
            kinds.setdefault(key, []).append(layer)
        counts = [len(layers) for layers in kinds.values()]
        full = len(kinds.get(None, ()))

        def padding(size: int) -> tuple[int, float, int]:  # full groups', overall, groups
            groups = sum(cdiv(n, size) for n in counts)
            return -full % size, 1 - len(windows) / (groups * size), groups

        sizes = [s for s in range(1, max(counts) + 1) if padding(s)[2] <= MAX_GROUPS]
        size = min(sizes or [max(counts)], key=padding)
        groups = []
        for window, layers in kinds.items():
            kind = KVCacheGroupKind.FULL_ATTENTION
            if window == KVCacheGroupKind.RECURRENT.value:
                kind, window = KVCacheGroupKind.RECURRENT, None
            elif window is not None:
                kind = KVCacheGroupKind.SLIDING_WINDOW
            for start in range(0, len(layers), size):
                groups.append(KVCacheGroup(kind, tuple(layers[start : start + size]), window))
        return cls(tuple(groups), size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether blocks are managed per group (more than one group, or windows)."""
        return self.num_groups > 1 or self.groups[0].window is not None

    @property
    def recurrent_layers(self) -> frozenset[int]:
        """The model layers of RECURRENT groups (linear attention)."""
        return frozenset(
            layer for g in self.groups if g.kind is KVCacheGroupKind.RECURRENT for layer in g.layers
        )

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @cached_property
    def placement(self) -> tuple[tuple[int, int], ...]:
        """Per model layer, (group index, tensor index); computed once."""
        places = {
            layer: (g, j)
            for g, group in enumerate(self.groups)
            for j, layer in enumerate(group.layers)
        }
        return tuple(places[layer] for layer in range(self.num_layers))

    @cached_property
    def group_of_layer(self) -> tuple[int, ...]:
        """Per model layer, its group's index (what each layer's attention reads)."""
        return tuple(g for g, _ in self.placement)

    def place(self, layer: int) -> tuple[int, int]:
        """(group index, tensor index) of model layer `layer`."""
        return self.placement[layer]

    @property
    def padding_share(self) -> float:
        """The share of page memory no layer uses (short last chunks of a kind)."""
        used = self.num_layers
        return 1 - used / (self.num_groups * self.layers_per_group)

    def max_blocks_per_sequence(self, max_model_len: int, max_chunk: int, block_size: int) -> int:
        """The most pages one sequence of up to `max_model_len` tokens, computed in
        chunks of at most `max_chunk` tokens, holds at once: every block in a full
        group; a chunk plus the window before it (and a block of misalignment) in a
        windowed one. A cache smaller than this could leave a lone request stuck."""
        total = 0
        for group in self.groups:
            full = cdiv(max_model_len, block_size)
            if group.window is not None:
                span = cdiv(group.window - 1 + min(max_chunk, max_model_len), block_size)
                full = min(full, span + 1)
            total += full
        return total

    def blocks_needed(self, num_computed: int, num_tokens: int, block_size: int) -> int:
        """Pages all groups hold for one sequence (`KVCacheGroup.blocks_needed`)."""
        return sum(g.blocks_needed(num_computed, num_tokens, block_size) for g in self.groups)
