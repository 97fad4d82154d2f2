"""What the native attention tests (float and 8-bit caches) share: the optional
features a case names, random queries, the block id no context uses, thread counts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cuda_ext import reference

UNUSED_BLOCK = 10**9  # in block-table columns past a context: the kernels must not read them


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(frozen=True)
class Features:
    """The attention ops' optional features, as a test case names them."""

    sliding_window: int = 0
    soft_cap: float = 0.0
    sinks: bool = False

    def arguments(self, num_heads: int, rng: torch.Generator) -> dict:
        """The keyword arguments the ops and the reference take; sink logits from rng."""
        sinks = torch.randn(num_heads, generator=rng) * 2 if self.sinks else None
        return dict(sliding_window=self.sliding_window, soft_cap=self.soft_cap, sinks=sinks)


NO_FEATURES = Features()


def shuffled_block_tables(
    seq_lens: list[int], block_size: int, rng: torch.Generator, index: torch.dtype
) -> tuple[torch.Tensor, int]:
    """Block tables for sequences of `seq_lens` tokens, and the number of blocks: later
    sequences share their first blocks with sequence 0 (a common prefix), the blocks
    are shuffled, and columns past a context hold UNUSED_BLOCK. `index`: int32/int64."""
    tables, next_block = [], 0
    for length in seq_lens:
        need = cdiv(length, block_size)
        prefix = tables[0][: min(need, len(tables[0])) // 2] if tables else []
        tables.append(prefix + list(range(next_block, next_block + need - len(prefix))))
        next_block += need - len(prefix)
    num_blocks = next_block + 3
    perm = torch.randperm(num_blocks, generator=rng).tolist()
    width = max((len(t) for t in tables), default=0) + 2
    block_tables = torch.full((len(tables), width), UNUSED_BLOCK, dtype=index)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor([perm[b] for b in table])
    return block_tables, num_blocks


def random_query(num_tokens, num_heads, head_size, dtype, rng):
    # Varied magnitudes make some softmaxes peaked: the running max must be right.
    magnitude = torch.empty(num_tokens, num_heads, 1).uniform_(0.3, 4.0, generator=rng)
    return (torch.randn(num_tokens, num_heads, head_size, generator=rng) * magnitude).to(dtype)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """n torch (OpenMP) threads inside the block; the session runs on 1."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class PagedCaches:
    """What both test caches (float and 8-bit) give: `block_tables`, `seq_lens`, and
    `key_cache` / `value_cache` in the house (token-major) layout, set by a subclass."""

    block_tables: torch.Tensor
    seq_lens: list[int]
    key_cache: torch.Tensor
    value_cache: torch.Tensor

    def slots(self, seq: int, length: int) -> torch.Tensor:
        block_size = self.key_cache.shape[1]
        pos = torch.arange(length)
        return self.block_tables[seq].long()[pos // block_size] * block_size + pos % block_size

    def native_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches head-major, as the native kernels take them."""
        return reference.head_major(self.key_cache), reference.head_major(self.value_cache)

    def seq_lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int64)
