"""`TensorParallelGroup`: this process's place among the ranks of one model, and the two
collectives tensor parallelism needs, on torch.distributed (gloo on CPUs, NCCL on GPUs).

Contract: every rank calls the collectives in the same order with tensors of the same
shape (the layers guarantee it: each runs the same step plan). With one rank every
collective returns its input unchanged, so single-device code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank `rank` of `world_size` (0 of 1: no parallelism)."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @classmethod
    def initialize(
        cls, rank: int, world_size: int, init_method: str, backend: str | None = None
    ) -> TensorParallelGroup:
        """Joins the default process group (`init_method`: `tcp://HOST:PORT` or
        `file://PATH`); backend: NCCL when CUDA is available, else gloo."""
        if world_size > 1 and not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size
            )
        return cls(rank, world_size)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (every rank gets it)."""
        if self.is_parallel:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order."""
        if not self.is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `size` (ValueError naming `what`
        when the ranks cannot share it evenly)."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) does not split evenly over tensor_parallel_size={self.world_size}"
            )
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part
