"""The "window ignored" baseline: paged tables where every layer keeps every token."""

from __future__ import annotations

from typing import Unpack

from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv.kv_cache_manager import KVCacheManager, TableOptions


class WindowIgnoringKVCacheManager(KVCacheManager):
    """`KVCacheManager` for a model with sliding-window layers that keeps every
    layer's K/V of every token (pages of all layers, nothing let go), as engines
    without a hybrid allocator do. Only its accounting knows the windows:
    `needed_slots` counts, averaged over the layers, the tokens a layer still reads, so
    the rest shows as waste (and the simulator's steps read only the windows, as the
    kernels would)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        layout: KVCacheLayout,
        **options: Unpack[TableOptions],
    ) -> None:
        super().__init__(num_blocks, block_size, **options)
        self._layer_windows = [
            group.sliding_window for group in layout.groups for _ in group.layers
        ]

    def needed_slots(self, num_tokens: int) -> int:
        windows = self._layer_windows
        read = sum(num_tokens if w is None else min(num_tokens, w) for w in windows)
        return round(read / len(windows))
