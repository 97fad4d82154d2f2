"""The layers that split a matmul over a `TensorParallelGroup` (Megatron-LM's scheme).

- `ColumnParallelLinear`: each rank holds a slice of the output features; its output is
  this rank's slice (QKV, gate/up, fc1: followed by a per-head or elementwise op that
  needs no other rank's part). Several projections of one input may share it (q, k, v;
  gate, up): each is a `Part` of the output, sliced on its own.
- `RowParallelLinear`: each rank holds a slice of the input features; its partial
  products are summed by an all-reduce (attention output, down projection, fc2). The
  bias is added once, after the sum.
- `VocabParallelEmbedding`: each rank holds a slice of the vocabulary's rows; ids outside
  it give zeros, and an all-reduce fills every row.
- `ParallelLMHead`: each rank computes the logits of its vocabulary slice; they are
  gathered for sampling (the padding past the real vocabulary dropped).

Each takes whole checkpoint tensors through `load(name, tensor, part)` and keeps this
rank's slice, so a rank never holds more than its share once loading is done. With one
rank each layer computes exactly what the plain torch layer computes (the same op, so
the Hugging Face parity tests hold bit for bit).

`transposed=True` keeps HF GPT-2's `Conv1D` layout: the weight is `[in, out]` and
`y = x @ W + b`, so those checkpoints load without a transpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext.packed_gemm import PackedWeight
from engine.worker.parallel.group import TensorParallelGroup


@dataclass(frozen=True)
class Part:
    """One projection's output features in a column-parallel weight: `full` in the
    checkpoint, of which this rank keeps [start, start + size)."""

    full: int
    start: int
    size: int

    @classmethod
    def even(cls, full: int, group: TensorParallelGroup, what: str) -> Part:
        """This rank's equal share of `full` (ValueError naming `what` if uneven)."""
        start, end = group.shard(full, what)
        return cls(full, start, end - start)


def head_parts(
    num_heads: int, num_kv_heads: int, head_size: int, group: TensorParallelGroup
) -> tuple[Part, Part, Part]:
    """q, k and v of this rank: an equal share of the query heads; of the key/value
    heads an equal share, or, when there are fewer of them than ranks, one of them
    replicated (rank r holds head r // (world_size / num_kv_heads), the one its query
    heads attend with)."""
    world = group.world_size
    heads = group.shard(num_heads, "num_attention_heads")
    q = Part(num_heads * head_size, heads[0] * head_size, (heads[1] - heads[0]) * head_size)
    if num_kv_heads >= world:
        kv_start, kv_end = group.shard(num_kv_heads, "num_key_value_heads")
    else:
        if world % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size "
                f"({world}) when it is smaller, so each rank can hold a copy of one"
            )
        kv_start = group.rank // (world // num_kv_heads)
        kv_end = kv_start + 1
    kv_full = num_kv_heads * head_size
    kv = Part(kv_full, kv_start * head_size, (kv_end - kv_start) * head_size)
    return q, kv, kv


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """Key/value heads each rank caches: a share, or one replicated head."""
    return max(1, num_kv_heads // world_size)


class ColumnParallelLinear(nn.Module):
    """y = x @ W[this rank's rows of each part].T (+ b[same]): [n, in] -> [n, sum sizes].

    `checkpoint_parts`: how many checkpoint tensors fill the weight, one per part (q, k
    and v stored apart: the loader passes each one's index), or None when one tensor
    holds all parts concatenated (GPT-2's c_attn, or a single projection)."""

    def __init__(
        self,
        in_features: int,
        parts: tuple[Part, ...],
        bias: bool,
        group: TensorParallelGroup,
        transposed: bool = False,
        separate_in_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.parts, self.transposed = group, parts, transposed
        self.sizes = tuple(p.size for p in parts)  # this rank's output slices, in order
        out = sum(self.sizes)
        shape = (in_features, out) if transposed else (out, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.checkpoint_parts = len(parts) if separate_in_checkpoint else None
        self.packed: PackedWeight | None = None  # set by `prepack_layer`, after loading

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [..., sum] -> parts
        return out.split(self.sizes, dim=-1)

    def load(self, name: str, tensor: torch.Tensor, part: int | None) -> None:
        """Copies this rank's rows of checkpoint tensor `name` ("weight" or "bias"):
        part `part`'s, or, with None, every part's from their concatenation."""
        dest, dim = self._param(name), self._out_dim(name)
        parts = self.parts if part is None else (self.parts[part],)
        offset = 0 if part is None else sum(self.sizes[:part])
        copy_parts(dest.narrow(dim, offset, sum(p.size for p in parts)), tensor, parts, dim)

    def _param(self, name: str) -> nn.Parameter:
        return self.weight if name == "weight" else self.bias

    def _out_dim(self, name: str) -> int:
        return 1 if name == "weight" and self.transposed else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, sum(sizes)]
        return _linear(self, x, self.bias)


class RowParallelLinear(nn.Module):
    """y = (sum over ranks of x[:, in slice] @ W[:, in slice].T) + b: [n, in / world]
    (this rank's slice, as a column-parallel layer leaves it) -> [n, out]."""

    checkpoint_parts = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: TensorParallelGroup,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.transposed = group, transposed
        self.start, end = group.shard(in_features, "input features")
        local = end - self.start
        shape = (local, out_features) if transposed else (out_features, local)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: PackedWeight | None = None  # set by `prepack_layer`, after loading

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        with torch.no_grad():
            if name == "bias":
                check_shape(tensor, self.bias.shape)
                self.bias.copy_(tensor)
                return
            dim = 0 if self.transposed else 1
            expected = list(self.weight.shape)
            expected[dim] *= self.group.world_size
            check_shape(tensor, expected)
            self.weight.copy_(tensor.narrow(dim, self.start, self.weight.shape[dim]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / world] -> [n, out]
        if not self.group.is_parallel:
            return _linear(self, x, self.bias)
        y = self.group.all_reduce(_linear(self, x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) vocabulary on this rank. ids: [n] -> [n, dim]."""

    checkpoint_parts = None

    def __init__(self, vocab_size: int, dim: int, group: TensorParallelGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        padded = -(-vocab_size // group.world_size) * group.world_size
        self.start, self.end = group.shard(padded, "vocabulary")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim))

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """`tensor`: [vocab_size, dim]; rows past the vocabulary (padding) are zero."""
        check_shape(tensor, (self.vocab_size, self.weight.shape[1]))
        with torch.no_grad():
            rows = tensor[self.start : min(self.end, self.vocab_size)]
            self.weight[rows.shape[0] :].zero_()
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

    packed: PackedWeight | None = None  # set by `prepack_layer`, after loading
    transposed = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _linear(self, hidden, None)  # [n, padded vocab / world]
        if not self.group.is_parallel:
            return logits
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab_size]


# The layers whose `load(name, tensor, part)` takes whole checkpoint tensors.
SLICING_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
# The layers whose weight `prepack_layer` can hand to a PackedWeight (models/prepack.py).
PACKABLE_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _linear(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] through `layer`'s packed weight when it has one, else its plain one."""
    if layer.packed is not None:
        return layer.packed(x, bias)
    return _matmul(x, layer.weight, bias, layer.transposed)


def prepack_layer(layer, keep_plain: bool) -> PackedWeight:
    """Packs `layer.weight` (as `[out, in]`) for oneDNN; without `keep_plain` the plain
    weight is dropped (an empty tensor of its dtype), so the layer holds its weight once.
    Call after loading: `load` writes into the plain weight."""
    weight = layer.weight.detach()
    layer.packed = PackedWeight(weight.t() if layer.transposed else weight)
    if not keep_plain:
        layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    return layer.packed


def _matmul(x, weight, bias, transposed: bool) -> torch.Tensor:
    if not transposed:
        return F.linear(x, weight, bias)
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


def copy_parts(dest: torch.Tensor, tensor: torch.Tensor, parts: tuple[Part, ...], dim: int) -> None:
    """Copies into `dest` (this rank's slices of `parts`, concatenated along `dim`) its
    slice of each part of `tensor` (the parts' whole checkpoint rows, concatenated)."""
    expected = list(dest.shape)
    expected[dim] = sum(p.full for p in parts)
    check_shape(tensor, expected)
    offset = src = 0
    with torch.no_grad():
        for p in parts:
            dest.narrow(dim, offset, p.size).copy_(tensor.narrow(dim, src + p.start, p.size))
            offset, src = offset + p.size, src + p.full


def check_shape(tensor: torch.Tensor, expected) -> None:
    """ValueError "has shape (...), the model expects (...)" (the loader names the tensor)."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(expected)}")
