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
from cuda_ext.quant_gemm import QuantType, quantize
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.quantized_weight import QuantizedTensor, QuantizedWeight


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
        # set by `prepack_layer` after loading, or by `load` for a weight in GGUF blocks
        self.packed: PackedWeight | QuantizedWeight | None = None
        self._quantized: dict[int, QuantizedTensor] | None = None  # parts in blocks, loading
        self._float_parts: set[int] = set()
        self.quantize_to: QuantType | None = None  # quantize the float weight once loaded

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [..., sum] -> parts
        return out.split(self.sizes, dim=-1)

    def load(self, name: str, tensor: torch.Tensor | QuantizedTensor, part: int | None) -> None:
        """Copies this rank's rows of checkpoint tensor `name` ("weight" or "bias"):
        part `part`'s, or, with None, every part's from their concatenation. A weight
        in GGUF blocks (`QuantizedTensor`) is kept in them: once every part is loaded the
        layer computes with a `QuantizedWeight` (or, when some parts came as floats,
        with the float weight, the blocks dequantized into it)."""
        indices = range(len(self.parts)) if part is None else (part,)
        if name == "weight" and self._quantized is None:
            self._quantized, self._float_parts = {}, set()
        if name == "weight" and isinstance(tensor, QuantizedTensor) and not self.transposed:
            check_shape(tensor, (sum(self.parts[i].full for i in indices), self.weight.shape[1]))
            src = 0
            for i in indices:
                p = self.parts[i]
                self._quantized[i] = tensor.narrow(0, src + p.start, p.size)
                src += p.full
        else:
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize().to(self.weight.dtype)
            dest, dim = self._param(name), self._out_dim(name)
            parts = tuple(self.parts[i] for i in indices)
            offset = sum(self.sizes[: indices[0]])
            copy_parts(dest.narrow(dim, offset, sum(p.size for p in parts)), tensor, parts, dim)
            if name == "weight":
                self._float_parts.update(indices)
        if name == "weight" and len(self._quantized) + len(self._float_parts) == len(self.parts):
            self._finish_quantized()

    def _finish_quantized(self) -> None:
        """All parts are in: compute in blocks if every part came in blocks, else
        dequantize the parts that did into the float weight."""
        quantized, self._quantized = self._quantized, None
        if not quantized:
            _quantize_loaded_weight(self)
            return
        if len(quantized) == len(self.parts):
            self.packed = QuantizedWeight([quantized[i] for i in range(len(self.parts))])
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        with torch.no_grad():
            for i, tensor in quantized.items():
                rows = self.weight.narrow(0, sum(self.sizes[:i]), self.sizes[i])
                rows.copy_(tensor.dequantize())

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
        # set by `prepack_layer` after loading, or by `load` for a weight in GGUF blocks
        self.packed: PackedWeight | QuantizedWeight | None = None
        self.quantize_to: QuantType | None = None  # quantize the float weight once loaded

    def load(
        self, name: str, tensor: torch.Tensor | QuantizedTensor, part: int | None = None
    ) -> None:
        """Copies this rank's columns of checkpoint tensor `name`; a weight in GGUF
        blocks stays in them when this rank's columns fall on block boundaries."""
        dim = 0 if self.transposed else 1
        if name == "weight" and isinstance(tensor, QuantizedTensor) and not self.transposed:
            expected = list(self.weight.shape)
            expected[dim] *= self.group.world_size
            check_shape(tensor, expected)
            try:
                mine = tensor.narrow(1, self.start, self.weight.shape[1])
            except ValueError:  # this rank's columns split a block: compute in floats
                tensor = tensor.dequantize()
            else:
                self.packed = QuantizedWeight([mine])
                self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
                return
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize().to(self.weight.dtype)
        with torch.no_grad():
            if name == "bias":
                check_shape(tensor, self.bias.shape)
                self.bias.copy_(tensor)
                return
            expected = list(self.weight.shape)
            expected[dim] *= self.group.world_size
            check_shape(tensor, expected)
            self.weight.copy_(tensor.narrow(dim, self.start, self.weight.shape[dim]))
        _quantize_loaded_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / world] -> [n, out]
        if not self.group.is_parallel:
            return _linear(self, x, self.bias)
        y = self.group.all_reduce(_linear(self, x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) vocabulary on this rank. ids: [n] -> [n, dim].
    Rows given in GGUF blocks stay in them (`quantized`): a lookup dequantizes the rows
    it reads."""

    checkpoint_parts = None

    def __init__(self, vocab_size: int, dim: int, group: TensorParallelGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        padded = -(-vocab_size // group.world_size) * group.world_size
        self.start, self.end = group.shard(padded, "vocabulary")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim))
        self.dtype = self.weight.dtype
        self.quantized: QuantizedTensor | None = None

    def load(
        self, name: str, tensor: torch.Tensor | QuantizedTensor, part: int | None = None
    ) -> None:
        """`tensor`: [vocab_size, dim]; rows past the vocabulary (padding) are zero (in
        blocks: zero bytes, which every type decodes to 0)."""
        check_shape(tensor, (self.vocab_size, self.weight.shape[1]))
        mine = max(0, min(self.end, self.vocab_size) - self.start)
        if isinstance(tensor, QuantizedTensor):
            rows = tensor.narrow(0, min(self.start, self.vocab_size), mine).blocks
            pad = rows.new_zeros(self.end - self.start - mine, rows.shape[1])
            self.quantized = QuantizedTensor(torch.cat([rows, pad]), tensor.qtype, tensor.k)
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        with torch.no_grad():
            rows = tensor[self.start : self.start + mine]
            self.weight[rows.shape[0] :].zero_()
            self.weight[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.group.is_parallel:
            return self._rows(ids)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = self._rows(local) * mine.unsqueeze(-1).to(self.dtype)
        return self.group.all_reduce(out)

    def _rows(self, local_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, dim]
        if self.quantized is None:
            return F.embedding(local_ids, self.weight)
        rows = self.quantized.blocks[local_ids.reshape(-1)]
        values = QuantizedTensor(rows, self.quantized.qtype, self.quantized.k).dequantize()
        return values.to(self.dtype).reshape(*local_ids.shape, -1)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary slice, gathered: [n, dim] -> [n, vocab_size]."""

    packed: PackedWeight | QuantizedWeight | None = None  # set by `prepack_layer` or `load`
    transposed = False

    def load(
        self, name: str, tensor: torch.Tensor | QuantizedTensor, part: int | None = None
    ) -> None:
        super().load(name, tensor, part)
        if self.quantized is not None:
            self.packed = QuantizedWeight([self.quantized])

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """After loading: the head computes with the embedding's rows (in blocks if so)."""
        self.weight, self.quantized = embedding.weight, embedding.quantized
        if self.quantized is not None:
            self.packed = QuantizedWeight([self.quantized])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _linear(self, hidden, None)  # [n, padded vocab / world]
        if not self.group.is_parallel:
            return logits
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab_size]


# The layers whose `load(name, tensor, part)` takes whole checkpoint tensors.
SLICING_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
# The layers that keep a weight given in GGUF blocks in them (a QuantizedWeight).
QUANTIZED_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
# The layers that can quantize a float weight at load (`quantize_to`).
LINEAR_LAYERS = (ColumnParallelLinear, RowParallelLinear)
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


def _quantize_loaded_weight(layer) -> None:
    """A layer asked to (`quantize_to`) computes its just-loaded float weight in blocks."""
    if layer.quantize_to is None or layer.transposed:
        return
    weight = layer.weight.detach().float()  # [out, in]
    blocks = QuantizedTensor(
        quantize(weight, layer.quantize_to), layer.quantize_to, weight.shape[1]
    )
    layer.packed = QuantizedWeight([blocks])
    layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)


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
