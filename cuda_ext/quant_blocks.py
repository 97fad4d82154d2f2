"""GGUF block types and their byte layouts (ggml's ids; `cuda_ext.quant_gemm` computes
with them, `cuda_ext.native_cpu` checks its kernel's arguments against them)."""

from __future__ import annotations

from enum import IntEnum


class QuantType(IntEnum):
    """The supported block types, with ggml's type ids (`gguf.GGMLQuantizationType`)."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


BLOCK_SHAPES: dict[QuantType, tuple[int, int]] = {  # (elements, bytes) per block
    QuantType.Q4_0: (32, 18),
    QuantType.Q4_1: (32, 20),
    QuantType.Q5_0: (32, 22),
    QuantType.Q5_1: (32, 24),
    QuantType.Q8_0: (32, 34),
    QuantType.Q4_K: (256, 144),
    QuantType.Q5_K: (256, 176),
    QuantType.Q6_K: (256, 210),
}

QUANTIZABLE = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1)  # what `quantize` writes


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def row_bytes(qtype: QuantType, k: int) -> int:
    """Bytes of one quantized row of k elements (its last block may be partial)."""
    elements, nbytes = BLOCK_SHAPES[QuantType(qtype)]
    return cdiv(k, elements) * nbytes
