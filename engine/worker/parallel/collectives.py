"""Contiguous shares of a count over ranks, and collectives of such uneven shards, on
torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist


def share_bounds(total: int, parts: int) -> list[int]:
    """Cut points of `total` into `parts` contiguous shares of sizes differing by at most
    one, the larger first: share r is [cuts[r], cuts[r + 1])."""
    base, extra = divmod(total, parts)
    return [r * base + min(r, extra) for r in range(parts + 1)]


def gather_rows(x: torch.Tensor, sizes: list[int] | tuple[int, ...], group=None) -> torch.Tensor:
    """Every rank's `x` of `sizes[r]` rows, concatenated in rank order ([sum(sizes), ...]);
    the shards travel padded to the largest (all_gather wants one shape), the padding
    dropped. `group`: the process group (None: every rank)."""
    width = max(sizes)
    padded = x
    if x.shape[0] < width:
        padded = torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
