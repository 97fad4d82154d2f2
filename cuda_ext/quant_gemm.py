"""Matrix products with GGUF-quantized weights kept in llama.cpp's block layout.

A quantized weight `[N, k]` is `blocks`, uint8 `[N, row_bytes(qtype, k)]`: each row is
ceil(k / elements) blocks of ggml's layout for `qtype` (what a GGUF file stores, byte for
byte). The native kernel (`cuda_ext/csrc/cpu/quant_gemm.cpp`) multiplies activations by
it without ever building a float weight matrix, as llama.cpp's CPU backend does: each
activation row is quantized once per call, per block (int8 blocks of 32 with a float32
scale for the 32-element types, blocks of 256 for the k-quants), and the dot products
are integer (AVX-512 VNNI / AVX2 where the build has them), scaled into float32 sums.
So the kernel's only approximation is the activation's rounding to int8: |error| <=
sum over activation blocks of (max |x| in the block / 254) * sum |w| over the block
with `levels=1` (llama.cpp's scheme). The default, `levels=2`, rounds what that left
as a second int8 row (the weights decoded once for both) and sums the two products: the
bound is then that of the residual, about 2^-7 of the first, for twice the integer work.
One level changed the default model's answers; two keep them (docs/quantization.md).
The panel methods (`Method`) round nothing: each thread decodes a panel of W's rows
into float32 in cache and multiplies x by it with a float GEMM (oneDNN's, or torch's
mm), faster once many rows share each decoded weight; `pick_method` chooses per call
for a loaded layer.

    y = quantized_matmul(x, blocks, QuantType.Q4_0, k)  # x [M, k] -> y [M, N], x's dtype

`dequantize` (pure torch) is the reference: it equals `gguf.quants.dequantize` bit for
bit. `quantize` writes Q8_0 / Q4_0 / Q4_1 blocks from a float weight as llama.cpp's
reference quantizers do (for quantizing a float checkpoint at load). A row's last block
may be partial when k is not a multiple of the block size: `quantize` zero-pads it and
every other function ignores its elements past k (GGUF files never have such rows).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cuda_ext.packed_gemm import packed_gemm_support
from cuda_ext.quant_blocks import BLOCK_SHAPES, QUANTIZABLE, QuantType, cdiv, row_bytes

if TYPE_CHECKING:
    from cuda_ext.native_cpu import NativeCpuOps


class Method(enum.IntEnum):
    """How the native `quantized_matmul` computes (its `levels` argument)."""

    ONEDNN_PANELS = -1  # W decoded into float32 panels, oneDNN's GEMM on each
    MM_PANELS = 0  # W decoded into float32 panels, torch's mm (MKL) on each
    ROUNDED_ONCE = 1  # integer dot products, activations rounded to int8 once
    ROUNDED_TWICE = 2  # integer dot products, activations rounded twice


def supported_natively(qtype: QuantType) -> bool:
    """Whether `quantized_matmul` runs the native kernel for qtype here."""
    return qtype in BLOCK_SHAPES and _native_ops() is not None


def quantized_matmul(
    x: torch.Tensor,  # [M, k] float32 or bfloat16, unit last stride
    blocks: torch.Tensor,  # [N, row_bytes(qtype, k)] uint8, contiguous
    qtype: QuantType,
    k: int,
    levels: int = Method.ROUNDED_TWICE,
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ W.T for the quantized weight W [N, k]; the native kernel where it loads, by
    `levels` (a `Method`: activations rounded to int8 once or twice, or float panels)."""
    ops = _native_ops()
    if ops is None:
        return reference_quantized_matmul(x, blocks, qtype, k)
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=x.dtype)
    ops.quantized_matmul(out, x, blocks, qtype, k, levels)
    return out


def pick_method(rows: int, k: int, onednn: bool) -> Method:
    """The method for a layer's product of `rows` activation rows of width k: integer
    dot products where reading the weight is the cost (few rows), float panels (no
    rounding) where the arithmetic is. Measured on 2 AVX-512 cores, weights from DRAM
    (`python bench/quant_gemm.py --methods`, bench/results/quant_gemm_methods_*.json),
    integer kernel / oneDNN panels in ms:
    - k = 576 (SmolLM2's 3072 x 576, Q4_1): 0.21 / 0.23 at 8 rows, 0.42 / 0.29 at 16,
      1.65 / 0.61 at 64, 76.0 / 16.1 at 2,048 (oneDNN over the prepacked float32
      weight: 0.20, 0.25, 0.58, 14.1);
    - k = 1536 (576 x 1536): 0.088 / 0.111 at 8, 0.159 / 0.136 at 16;
    - k = 4096 (4096 x 4096, Q4_K): 2.22 / 3.01 at 16 rows, 4.24 / 4.13 at 32, 8.46 /
      6.04 at 64; k = 14336 (Q4_K): 7.33 / 10.3 at 16, 14.8 / 16.4 at 32, 30.2 / 23.2
      at 64.
    MKL panels stand in where torch has no oneDNN: half its speed on this AMD CPU (MKL
    takes its AVX2 path), so they pay from more rows: at k = 576 from about 16 (0.40 /
    0.42 ms), at k = 4096 not yet at 512 (83.6 against the integer kernel's 78.6).
    """
    wide = k >= PANEL_WIDE_K
    if onednn:
        panels, min_rows = Method.ONEDNN_PANELS, (32 if wide else 16)
    else:
        panels, min_rows = Method.MM_PANELS, (1024 if wide else 24)
    return panels if rows >= min_rows else Method.ROUNDED_TWICE


PANEL_WIDE_K = 2048  # from this width the integer kernel keeps more rows (above)


def matmul_kernel() -> Callable[[torch.Tensor, torch.Tensor, QuantType, int], torch.Tensor]:
    """`quantized_matmul` for a caller that built its arguments right once (a loaded
    layer): the native kernel without the wrapper's Python checks, about 3.6 us a call
    (the kernel still checks shapes and types), its method picked by `pick_method`;
    or the reference where the kernels cannot load."""
    ops = _native_ops()
    if ops is None:
        return reference_quantized_matmul
    kernel = ops.unchecked.quantized_matmul
    onednn = _onednn_float32()

    def run(x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=x.dtype)  # [M, N]
        kernel(out, x, blocks, int(qtype), k, int(pick_method(x.shape[0], k, onednn)))
        return out

    return run


def reference_quantized_matmul(
    x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, k: int
) -> torch.Tensor:  # [M, k] x [N, row_bytes] -> [M, N], x's dtype
    """The float product with the dequantized weight (no activation quantization)."""
    _check_blocks(blocks, qtype, k)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}]; got {list(x.shape)}")
    return (x.float() @ dequantize(blocks, qtype, k).T).to(x.dtype)


@functools.cache
def _onednn_float32() -> bool:
    """Whether torch's oneDNN multiplies float32 here (probed once per process)."""
    return packed_gemm_support(torch.float32) is None


@functools.cache
def _native_ops() -> NativeCpuOps | None:
    from cuda_ext.native_cpu import NativeCpuOps

    return NativeCpuOps.load()


# ---------------------------------------------------------------- dequantize (reference)


def dequantize(blocks: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """blocks [N, row_bytes(qtype, k)] uint8 -> float32 [N, k], as gguf.quants.dequantize
    (the same float32 operations in the same order, so bit for bit)."""
    qtype = QuantType(qtype)
    _check_blocks(blocks, qtype, k)
    elements, nbytes = BLOCK_SHAPES[qtype]
    rows = blocks.shape[0]
    b = blocks.reshape(-1, nbytes)  # [rows * blocks_per_row, nbytes]
    values = _DEQUANTIZE[qtype](b)  # [rows * blocks_per_row, elements]
    return values.reshape(rows, -1)[:, :k]


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:  # [n, nbytes] -> [n, 1] float32
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, bytes] -> [n, 2 * bytes]: all low nibbles, then all high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, b] uint8 (a little-endian integer) -> [n, 8 * b] uint8: its bits, lowest first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], -1)


def _dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:  # 5-bit values of a Q5_0 / Q5_1 block
    return _nibbles(b[:, qh_at + 4 :]) | (_bits(b[:, qh_at : qh_at + 4]) << 4)


def _dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_q5(b, 2).to(torch.int8) - 16).float()


def _dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _q5(b, 4).float() + _f16(b, 2)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> ([n, 8], [n, 8]) uint8."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: d * scale_j * q - dmin * min_j over 8 sub-blocks of 32."""
    sc, mins = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * sc.float())[:, :, None]  # [n, 8, 1]
    dm = (_f16(b, 2) * mins.float())[:, :, None]
    return (d * q.reshape(-1, 8, 32).float() - dm).reshape(-1, 256)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 256]: 32-byte group g holds sub-blocks 2g (low) and 2g + 1 (high)."""
    g = qs.reshape(-1, 4, 1, 32)
    return torch.cat([g & 0x0F, g >> 4], dim=2).reshape(-1, 256)


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _k_nibbles(b[:, 16:]))


def _dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48][:, None, :] >> torch.arange(8, dtype=torch.uint8)[None, :, None]
    return _k_affine(b, _k_nibbles(b[:, 48:]) | ((qh & 1) << 4).reshape(-1, 256))


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[None, None, :, None]
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16)
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float())[:, :, None]  # [n, 16, 1]
    return (d * q.float()).reshape(-1, 256)


_DEQUANTIZE = {
    QuantType.Q8_0: _dequantize_q8_0,
    QuantType.Q4_0: _dequantize_q4_0,
    QuantType.Q4_1: _dequantize_q4_1,
    QuantType.Q5_0: _dequantize_q5_0,
    QuantType.Q5_1: _dequantize_q5_1,
    QuantType.Q4_K: _dequantize_q4_k,
    QuantType.Q5_K: _dequantize_q5_k,
    QuantType.Q6_K: _dequantize_q6_k,
}


# ---------------------------------------------------------------- quantize (at load)


def quantize(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """weight float [N, k] -> uint8 [N, row_bytes(qtype, k)], as llama.cpp's reference
    quantizers (and gguf.quants.quantize) write full blocks; a last partial block is
    zero-padded. Q8_0: round(x / d), d = max|x| / 127. Q4_0: trunc(x / d + 8.5) clipped
    to [0, 15], d = (the x of largest magnitude) / -8. Q4_1: trunc((x - min) / d + 0.5)
    clipped to [0, 15], d = (max - min) / 15. Scales are stored as float16."""
    qtype = QuantType(qtype)
    if qtype not in QUANTIZABLE:
        names = ", ".join(t.name for t in QUANTIZABLE)
        raise ValueError(f"quantize writes {names}; got {qtype.name} (use a GGUF file for it)")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [N, k]; got {list(weight.shape)} {weight.dtype}")
    rows, k = weight.shape
    padded = torch.zeros(rows, cdiv(k, 32) * 32, dtype=torch.float32)
    padded[:, :k] = weight.detach().to("cpu", torch.float32)
    x = padded.reshape(-1, 32)  # [blocks, 32]
    packed = {QuantType.Q8_0: _quantize_q8_0, QuantType.Q4_0: _quantize_q4_0,
              QuantType.Q4_1: _quantize_q4_1}[qtype](x)  # fmt: skip
    return packed.reshape(rows, row_bytes(qtype, k))


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:  # [n, 1] float32 -> [n, 2] uint8
    return d.half().view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:  # ggml's roundf, as gguf's np_roundf
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # [n, 32] in [0, 15] -> [n, 16]
    return q[:, :16] | (q[:, 16:] << 4)


def _quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = _round_half_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=1)


def _quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    d = signed_max / -8
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=1)


def _quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    high = x.amax(dim=1, keepdim=True)
    low = x.amin(dim=1, keepdim=True)
    d = (high - low) / 15
    q = torch.trunc((x - low) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_nibbles(q)], dim=1)


def _check_blocks(blocks: torch.Tensor, qtype: QuantType, k: int) -> None:
    if qtype not in BLOCK_SHAPES:
        raise ValueError(f"qtype must be one of {[t.name for t in QuantType]}; got {qtype}")
    nbytes = row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nbytes:
        raise ValueError(
            f"blocks must be uint8 [N, {nbytes}] ({QuantType(qtype).name} rows of {k} "
            f"elements); got {list(blocks.shape)} {blocks.dtype}"
        )
