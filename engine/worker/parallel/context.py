"""Context parallelism: one step's tokens split over ranks, K/V exchanged by all-gather.

Every rank holds the whole model and the same KV cache (the same blocks, every layer,
every token). A step's flattened tokens [T] split into `size` contiguous shards of about
T / size tokens, cutting through sequences where they fall: rank r runs only shard r
through the model, so a long prompt's prefill is shared by the ranks. At each attention
layer the ranks all-gather the shards' new keys and values (in token order: the step's
own order), each writes all T tokens' K/V into its cache with the step's slot mapping,
and each attends with its own queries only, which may read keys another rank computed
this step. After the last layer the hidden states are all-gathered, so every rank holds
the step's [T, hidden] as one device would; the sampling rank samples from them.

A step with fewer tokens than ranks (decoding a few sequences) is not split: every rank
computes it whole. Exchanging K/V by all-gather costs T x 2 x kv_heads x head_size values
per layer to every rank; a ring (each rank passing its shard on while attending to the
one it holds) would overlap it with compute, which a two-core CPU cannot show.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.worker.parallel.collectives import gather_rows, share_bounds


@dataclass(frozen=True)
class ContextParallel:
    """Rank `rank` of `size` context-parallel ranks (0 of 1: none)."""

    rank: int = 0
    size: int = 1

    @property
    def is_split(self) -> bool:
        return self.size > 1

    def splits(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens is split (each rank gets one at least)."""
        return self.is_split and num_tokens >= self.size

    def bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """Each rank's [start, end) of the step's tokens, in rank order."""
        return list(itertools.pairwise(share_bounds(num_tokens, self.size)))

    def shard(self, rows: Sequence[ScheduledRequest], num_tokens: int) -> list[ScheduledRequest]:
        """This rank's part of `rows` (in batch order): the rows, or pieces of rows, whose
        tokens fall in its shard; a piece computes from where the piece starts."""
        start, end = self.bounds(num_tokens)[self.rank]
        pieces, offset = [], 0
        for row in rows:
            first, last = max(start, offset), min(end, offset + row.num_scheduled_tokens)
            if first < last:
                computed = row.num_computed_tokens + first - offset
                pieces.append(
                    ScheduledRequest(row.request, computed, last - first, row.block_table)
                )
            offset += row.num_scheduled_tokens
        return pieces


@dataclass(frozen=True)
class ContextShards:
    """One split step, as the attention layers see it: the shards' sizes (rank order)
    and where each of the step's tokens' K/V goes."""

    sizes: tuple[int, ...]
    slot_mapping: torch.Tensor  # [T] int64, the whole step's

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # [t_r, ...] -> [T, ...]
        """Every rank's shard of `x`, concatenated in rank order."""
        return gather_rows(x, self.sizes)
