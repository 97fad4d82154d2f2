"""What the native attention tests (float and 8-bit caches) share: the optional
features a case names, random queries, the block id no context uses, thread counts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

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
