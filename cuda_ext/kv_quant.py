"""The 8-bit KV cache row format and its pure-torch reference (the kernels' oracle).

A cache in 8 bits stores each (token, KV head) row of `head_size` values as one byte
per value followed by the row's float32 scale (4 bytes, little-endian): a cache tensor
is uint8 with rows `head_size + 4` bytes wide, in whatever layout its backend uses
(head-major on the native CPU kernels). Keeping the scale inside the row means a row is
written once, by its own token, and never revisited; block copies (copy-on-write) and
swaps move the scales with the codes; the KV sizing counts them.

Encoding one row x (float32 math; a bfloat16 row is widened first):

    amax  = max |x|
    scale = amax / QMAX                  (0 when amax < FLT_MIN: the row codes as zeros)
    inv   = QMAX / amax                  (likewise 0: it would overflow)
    code  = encode(clamp(x * inv, -QMAX, QMAX))

with `encode` round-half-to-even to an int8 (QMAX 127), or the conversion to
float8_e4m3fn (QMAX 448) or float8_e5m2 (QMAX 57344) that torch and c10 share. Decoding:
`float(code) * scale`. Rows are finite (a model whose K/V are not has failed already;
the native encoder then codes a NaN value as 0, the reference leaves it unspecified).

A per-row scale spends the 8 bits on each row's own range (a K row with one large
channel costs only that row its precision), at 4 bytes per row: with 64-value heads a
row takes 68 bytes against 256 in float32 and 128 in bfloat16.
"""

from __future__ import annotations

from enum import IntEnum

import torch

SCALE_BYTES = 4  # the float32 scale at the end of each row


class KVRowCode(IntEnum):
    """How one row's values are coded; the integers are the native kernels' `kv_format`
    (0 is a float cache: rows of the model's dtype, no scale)."""

    INT8 = 1
    FP8_E4M3 = 2
    FP8_E5M2 = 3

    @property
    def qmax(self) -> float:
        """The largest magnitude a code holds: a row's amax maps to it."""
        return {KVRowCode.INT8: 127.0, KVRowCode.FP8_E4M3: 448.0, KVRowCode.FP8_E5M2: 57344.0}[self]

    @property
    def code_dtype(self) -> torch.dtype:
        """The torch dtype a row's codes read as."""
        return {
            KVRowCode.INT8: torch.int8,
            KVRowCode.FP8_E4M3: torch.float8_e4m3fn,
            KVRowCode.FP8_E5M2: torch.float8_e5m2,
        }[self]


def row_width(head_size: int) -> int:
    """Bytes of one coded row: its codes and its scale."""
    return head_size + SCALE_BYTES


def quantize_rows(x: torch.Tensor, code: KVRowCode) -> torch.Tensor:
    """[..., head_size] float32/bfloat16 -> [..., head_size + 4] uint8 coded rows."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    qmax = torch.tensor(code.qmax, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny  # FLT_MIN
    coded = amax >= tiny
    scale = torch.where(coded, amax / qmax, torch.zeros_like(amax))
    inv = torch.where(coded, qmax / amax.clamp_min(tiny), 0.0)
    scaled = (xf * inv).clamp(-code.qmax, code.qmax)
    if code is KVRowCode.INT8:
        codes = torch.round(scaled).to(torch.int8)
    else:
        codes = scaled.to(code.code_dtype)
    scale_bytes = scale.contiguous().view(torch.uint8)  # [..., 4], little-endian float32
    return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1)


def dequantize_rows(rows: torch.Tensor, code: KVRowCode) -> torch.Tensor:
    """[..., head_size + 4] uint8 coded rows -> [..., head_size] float32."""
    head_size = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_size].contiguous().view(code.code_dtype).float()
    scale = rows[..., head_size:].contiguous().view(torch.float32)  # [..., 1]
    return codes * scale
