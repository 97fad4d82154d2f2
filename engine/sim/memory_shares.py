"""Where the KV cache's slots go: tokens, reservations, waste and free space."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KVMemoryShares:
    """A snapshot of every KV slot (`block_size` per block), each in exactly one share,
    so the shares add up to `num_blocks * block_size` (`total`):

    - `token`: slots holding a token now.
    - `reserved`: slots a request will fill later (its need, prompt + output length,
      capped by its reservation, minus what it holds now).
    - `internal`: over-reservation, slots reserved beyond what the request will ever need.
    - `external`: slots the allocator hands out beyond the reservation (rounding up to
      whole blocks, a buddy allocator's rounding up to a power of two; a paged
      allocator's last partial block).
    - `free`: slots no request holds.

    Allocators without up-front reservations (paged) report `reserved` and `internal`
    as 0.
    """

    token: int
    reserved: int
    internal: int
    external: int
    free: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"KVMemoryShares.{f.name} must be >= 0, got {self}")

    @property
    def total(self) -> int:
        return self.token + self.reserved + self.internal + self.external + self.free

    @property
    def allocated(self) -> int:
        """Slots held by some request (everything but `free`)."""
        return self.total - self.free

    @property
    def used_by_tokens(self) -> float:
        """Fraction of the allocated slots that hold tokens (0.0 when none are allocated)."""
        return self.token / self.allocated if self.allocated else 0.0

    def fractions(self) -> dict[str, float]:
        """Each share as a fraction of `total` (they add up to 1)."""
        total = self.total
        return {f.name: getattr(self, f.name) / total for f in fields(self)}
