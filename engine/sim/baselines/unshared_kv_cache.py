"""`UnsharedKVCacheManager`: paged block tables that never keep a block shared.

The paper's ablation of its own sharing (Fig. 14, 15): the same paged allocation, but a
forked sequence (a parallel sample, a beam) copies every block it shares at its first
copy-on-write, instead of only the block it is about to write. Memory then grows with
n or the beam width as if each sequence had its own prompt.
"""

from __future__ import annotations

from engine.kv.block_tables import BlockCopy
from engine.kv.kv_cache_manager import KVCacheManager


class UnsharedKVCacheManager(KVCacheManager):
    """`KVCacheManager` whose `copy_on_write(seq_id, start)` copies every shared block of
    the table, whatever `start` is (None, nothing changed, when blocks run out)."""

    def copy_on_write(self, seq_id: str, start: int) -> list[BlockCopy] | None:
        return super().copy_on_write(seq_id, 0)
