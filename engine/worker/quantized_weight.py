"""Linear weights kept in a GGUF block type and multiplied in it (`--quantization gguf`).

`QuantizedTensor` is a checkpoint tensor `[rows, k]` still in its blocks (`blocks`
`[rows, row_bytes]` uint8: each row `ceil(k / block)` blocks of llama.cpp's layout). The
GGUF loader yields one for every weight of a type with a native kernel
(`cuda_ext.quant_gemm`); row operations (llama.cpp's q/k permutation undone, experts
split, a tensor-parallel rank's rows) act on the blocks' rows as on a float tensor's, and
a column slice must fall on block boundaries. A layer that cannot compute in blocks
(embeddings, experts) gets `dequantize()`d float values instead (`CausalLM._load_one`).

`QuantizedWeight` is what a linear layer computes with (it stands where a
`PackedWeight` would): the layer's parts (q, k and v of a fused projection; each part
may have its own type, as in Q4_K_M files where v is Q6_K) in output order, and
`weight(x, bias)` is `x @ W.T + bias` with W never dequantized as a whole. Parts of one
type are concatenated into one matrix at construction (one kernel call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext.quant_gemm import BLOCK_SHAPES, QuantType, dequantize, matmul_kernel

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations the kernels take


@dataclass(frozen=True)
class QuantizedTensor:
    """A `[rows, k]` weight in GGUF type `qtype`: `blocks` `[rows, row_bytes]` uint8."""

    blocks: torch.Tensor
    qtype: QuantType
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.k)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def narrow(self, dim: int, start: int, size: int) -> QuantizedTensor:
        """Rows (dim 0) anywhere; columns (dim 1) only on block boundaries (ValueError)."""
        if dim == 0:
            return QuantizedTensor(self.blocks.narrow(0, start, size), self.qtype, self.k)
        block, per_block = BLOCK_SHAPES[self.qtype]
        if start % block or (size % block and start + size != self.k):
            raise ValueError(
                f"columns [{start}, {start + size}) of a {self.qtype.name} weight do not fall "
                f"on its {block}-element blocks"
            )
        first, count = start // block, -(-size // block)
        cols = self.blocks.narrow(1, first * per_block, count * per_block)
        return QuantizedTensor(cols, self.qtype, size)

    def contiguous(self) -> QuantizedTensor:
        return QuantizedTensor(self.blocks.contiguous(), self.qtype, self.k)

    def dequantize(self) -> torch.Tensor:  # [rows, k] float32
        return dequantize(self.blocks.contiguous(), self.qtype, self.k)


class QuantizedWeight:
    """`x [n, k] -> x @ W.T (+ bias) [n, sum of the parts' rows]`, W kept in blocks (see
    the module docstring). Callable like `cuda_ext.packed_gemm.PackedWeight`."""

    def __init__(self, parts: list[QuantizedTensor]) -> None:
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("a quantized weight needs parts of one input width")
        merged: list[QuantizedTensor] = []
        for part in parts:  # consecutive parts of one type become one matrix
            if merged and merged[-1].qtype == part.qtype:
                last = merged.pop()
                part = QuantizedTensor(torch.cat([last.blocks, part.blocks]), part.qtype, part.k)
            merged.append(part.contiguous())
        self.parts = tuple(merged)
        self.in_features = parts[0].k
        self.out_features = sum(p.shape[0] for p in parts)
        self._matmul = matmul_kernel()  # the parts are built right: no checks per call

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [n, in_features]
        if rows.dtype not in KERNEL_DTYPES:  # float16: computed in float32
            rows = rows.float()
        outs = [self._matmul(rows, p.blocks, p.qtype, p.k) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [n, out_features]
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if bias is None else y + bias

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(p.qtype.name for p in self.parts)
