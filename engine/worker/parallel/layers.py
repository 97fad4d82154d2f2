"""The layers that split a matmul over a `TensorParallelGroup` (Megatron-LM's scheme).

- `ColumnParallelLinear`: each rank holds a slice of the output features (rows of the
  weight); its output is this rank's slice (QKV, gate/up: followed by a per-head or
  elementwise op that needs no other rank's part).
- `RowParallelLinear`: each rank holds a slice of the input features (columns); its
  partial products are summed by an all-reduce (attention output, down projection). The
  bias is added once, after the sum.
- `VocabParallelEmbedding`: each rank holds a slice of the vocabulary's rows; ids outside
  it give zeros, and an all-reduce fills every row.
- `ParallelLMHead`: each rank computes the logits of its vocabulary slice; they are
  gathered for sampling (the padding past the real vocabulary dropped).

`load(full)` on each takes the whole checkpoint tensor and keeps this rank's slice, so a
rank never holds more than its share once loading is done. With one rank each layer is
the plain layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.parallel.group import TensorParallelGroup


def _padded(size: int, world_size: int) -> int:
    return -(-size // world_size) * world_size


class ColumnParallelLinear(nn.Module):
    """y[..., this rank's out slice] = x @ W[slice].T (+ b[slice]). x: [n, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup):
        super().__init__()
        self.group = group
        self.start, self.end = group.shard(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, in_features))
        self.bias = nn.Parameter(torch.empty(self.end - self.start)) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            self.weight.copy_(weight[self.start : self.end])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias[self.start : self.end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [n, out / world]


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., in slice] @ W[:, in slice].T, then + b. x: [n, in /
    world] (this rank's slice, as a column-parallel layer leaves it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup):
        super().__init__()
        self.group = group
        self.start, self.end = group.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.end - self.start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            self.weight.copy_(weight[:, self.start : self.end])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))  # [n, out]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) vocabulary on this rank. ids: [n] -> [n, dim]."""

    def __init__(self, vocab_size: int, dim: int, group: TensorParallelGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.start, self.end = group.shard(_padded(vocab_size, group.world_size), "vocabulary")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim))

    def load(self, weight: torch.Tensor) -> None:
        """`weight`: [vocab_size, dim]; rows past the vocabulary (padding) are zero."""
        with torch.no_grad():
            self.weight.zero_()
            rows = weight[self.start : min(self.end, self.vocab_size)]
            self.weight[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.group.is_parallel:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary slice, gathered: [n, dim] -> [n, vocab_size]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # [n, vocab / world]
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab_size]
