"""GGUF-quantized matmul (cuda_ext.quant_gemm): the torch dequantizer against gguf's own,
`quantize` against gguf's quantizers, and the native kernel against the float product.

Tolerances. The kernel's one approximation is rounding each activation block (32
elements, or 256 for the k-quants) to int8: x_i ~ d * round(x_i / d), d = max|x| / 127,
so each x_i moves by at most d / 2 and an output by at most
sum over blocks b of (max_b |x| / 254) * sum_{i in b} |w_i| (`activation_bound`). That
bound is loose (worst case, every rounding error aligned), so each product is also held
to an exact emulation of that rounding (`quantized_activations`) within float32
summation (1e-5 of sum |x_q| |w|): a wrong scale on one block would pass the first check
at K = 4096 but not the second. bfloat16 outputs may differ by their rounding (2^-8).
"""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from cuda_ext.build import load_cpu_ops
from cuda_ext.native_cpu import NativeCpuOps
from cuda_ext.quant_gemm import (
    BLOCK_SHAPES,
    QUANTIZABLE,
    Method,
    QuantType,
    cdiv,
    dequantize,
    pick_method,
    quantize,
    quantized_matmul,
    reference_quantized_matmul,
    row_bytes,
    supported_natively,
)

pytestmark = pytest.mark.timeout(120)

LOADED = load_cpu_ops()
OPS = NativeCpuOps(LOADED.module) if LOADED.ok else None
needs_native = pytest.mark.skipif(
    OPS is None, reason=f"native CPU kernels unavailable: {LOADED.reason}"
)

TYPES = list(QuantType)
K_QUANTS = (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K)
# Byte offsets of each block's fp16 scales (d, and dmin / m where the type has one).
SCALE_OFFSETS = {
    QuantType.Q4_0: (0,), QuantType.Q5_0: (0,), QuantType.Q8_0: (0,),
    QuantType.Q4_1: (0, 2), QuantType.Q5_1: (0, 2), QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2), QuantType.Q6_K: (208,),
}  # fmt: skip
FLOAT_SUM_RTOL = 1e-5  # float32 products and sums, relative to sum |x_q| |w|
BF16_RTOL = 2.0**-8  # one rounding of the output to bfloat16


def random_blocks(rows: int, k: int, qtype: QuantType, gen: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random bytes (every value pattern, all scale bits of the
    k-quants) with sane fp16 scales: magnitudes in [1e-3, 2e-2], either sign."""
    elements, nbytes = BLOCK_SHAPES[qtype]
    blocks = torch.randint(0, 256, (rows * cdiv(k, elements), nbytes), dtype=torch.uint8,
                           generator=gen)  # fmt: skip
    for at in SCALE_OFFSETS[qtype]:
        magnitude = torch.rand(blocks.shape[0], 1, generator=gen) * 0.019 + 0.001
        sign = torch.randint(0, 2, (blocks.shape[0], 1), generator=gen) * 2 - 1
        blocks[:, at : at + 2] = (magnitude * sign).half().view(torch.uint8)
    return blocks.reshape(rows, -1)


def gguf_type(qtype: QuantType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(int(qtype))


def activation_block(qtype: QuantType) -> int:
    return 256 if qtype in K_QUANTS else 32


def rounded_blocks(x: torch.Tensor, block: int):
    """x [M, k] in float32 blocks of `block` (zero-padded) as the kernel rounds them:
    (blocks [M, blocks, block], d = max|x| / 127 [M, blocks, 1], q = round-half-even(x *
    (127 / max|x|)) computed in float32; quantize_block in cuda_ext/csrc/cpu/quant_gemm.cpp)."""
    rows, k = x.shape
    padded = torch.zeros(rows, cdiv(k, block) * block)
    padded[:, :k] = x.float()
    xb = padded.reshape(rows, -1, block)
    amax = xb.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return xb, amax / 127, torch.round(xb * inverse)


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, k] as the kernel rounds it, exactly (float64): d * q per block."""
    _, d, q = rounded_blocks(x, block)
    return (q.double() * d.double()).reshape(x.shape[0], -1)[:, : x.shape[1]]


def rounding_residual(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the first rounding leaves, in float32 as the kernel computes it: x - d * q
    (rounding_residual in cuda_ext/csrc/cpu/quant_gemm.cpp)."""
    xb, d, q = rounded_blocks(x, block)
    return (xb - d * q).reshape(x.shape[0], -1)[:, : x.shape[1]]


def activation_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """[M, N]: sum over blocks of (max |x| in the block / 254) * sum of |w| over it."""
    rows, k = x.shape
    padded = torch.zeros(rows, cdiv(k, block) * block, dtype=torch.float64)
    padded[:, :k] = x.double()
    half_step = padded.reshape(rows, -1, block).abs().amax(dim=2) / 254  # [M, blocks]
    w_padded = torch.zeros(w.shape[0], padded.shape[1], dtype=torch.float64)
    w_padded[:, :k] = w.double().abs()
    w_sums = w_padded.reshape(w.shape[0], -1, block).sum(dim=2)  # [N, blocks]
    return half_step @ w_sums.T


def assert_matches_float(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, qtype, levels: int = 2
) -> None:
    """got = quantized_matmul(x, W, levels) against the float product x @ w.T (w =
    dequantized W) within the activation's rounding (with two levels, the rounding of
    what the first left), and against its exact emulation within float32 summation (see
    the module docstring)."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    block = activation_block(qtype)
    y = got.double()
    out_rounding = BF16_RTOL if got.dtype == torch.bfloat16 else 0.0
    x_q = quantized_activations(x, block)
    rounded = x
    if levels == 2:
        rounded = rounding_residual(x, block)
        x_q = x_q + quantized_activations(rounded, block)
    emulated = x_q @ w.double().T
    magnitude = x_q.abs() @ w.double().abs().T
    emulation_tol = FLOAT_SUM_RTOL * magnitude + out_rounding * emulated.abs() + 1e-30
    assert ((y - emulated).abs() <= emulation_tol).all(), (
        f"{qtype.name}: worst |got - emulated| / tol "
        f"{((y - emulated).abs() / emulation_tol).max().item():.3g}"
    )
    exact = x.double() @ w.double().T
    bound = activation_bound(rounded, w, block)
    float_tol = bound + FLOAT_SUM_RTOL * magnitude + out_rounding * exact.abs() + 1e-30
    assert ((y - exact).abs() <= float_tol).all(), (
        f"{qtype.name}: worst |got - x @ w.T| / tol {((y - exact).abs() / float_tol).max():.3g}"
    )


# ---------------------------------------------------------------- layouts, reference


def test_types_and_block_shapes_are_ggmls():
    for qtype in TYPES:
        assert gguf.GGMLQuantizationType[qtype.name] == int(qtype)
        assert GGML_QUANT_SIZES[gguf_type(qtype)] == BLOCK_SHAPES[qtype]
    assert row_bytes(QuantType.Q4_0, 4096) == 128 * 18
    assert row_bytes(QuantType.Q4_0, 40) == 2 * 18  # the last block partial
    assert row_bytes(QuantType.Q6_K, 4096) == 16 * 210


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    gen = torch.Generator().manual_seed(int(qtype))
    elements = BLOCK_SHAPES[qtype][0]
    k = 5 * elements
    blocks = random_blocks(7, k, qtype, gen)
    expected = gguf.quants.dequantize(blocks.numpy(), gguf_type(qtype)).reshape(7, k)
    got = dequantize(blocks, qtype, k)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)))
    # A partial last block: the same rows, its elements past k ignored.
    assert torch.equal(
        dequantize(blocks, qtype, k - elements // 2 - 3), got[:, : k - elements // 2 - 3]
    )


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantize_equals_gguf_byte_for_byte(qtype):
    gen = torch.Generator().manual_seed(int(qtype))
    weight = torch.randn(9, 256, generator=gen)
    weight[3] = 0.0  # an all-zero block: scale 0, no division by it
    weight[4, :32] = 5.0  # a constant block
    expected = gguf.quants.quantize(weight.numpy(), gguf_type(qtype))
    assert torch.equal(quantize(weight, qtype), torch.from_numpy(expected))


def round_trip_bound(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Per element, the most quantize -> dequantize may move it: the rounding step of
    its block (Q8_0: d / 2; Q4_0: d, as the value -d * 8 clips to q = 15; Q4_1: d / 2),
    plus the fp16 rounding (2^-11 relative) of d times the largest |q - zero point| and of
    Q4_1's min."""
    k = weight.shape[1]
    padded = torch.zeros(weight.shape[0], cdiv(k, 32) * 32)
    padded[:, :k] = weight
    blocks = padded.reshape(weight.shape[0], -1, 32)
    high, low = blocks.amax(dim=2, keepdim=True), blocks.amin(dim=2, keepdim=True)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    fp16 = 2.0**-11
    if qtype == QuantType.Q8_0:
        d = amax / 127
        bound = d * (0.5 + 127 * fp16)
    elif qtype == QuantType.Q4_0:
        d = amax / 8
        bound = d * (1 + 8 * fp16)
    else:
        d = (high - low) / 15
        bound = d * (0.5 + 15 * fp16) + low.abs() * fp16
    return (bound * 1.0001 + 1e-7).expand_as(blocks).reshape(weight.shape[0], -1)[:, :k]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 40, 100, 4096])
def test_quantize_round_trips_within_its_step(qtype, k):
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(17, k, generator=gen) * torch.rand(17, 1, generator=gen)
    blocks = quantize(weight, qtype)
    assert blocks.shape == (17, row_bytes(qtype, k)) and blocks.dtype == torch.uint8
    error = (dequantize(blocks, qtype, k) - weight).abs()
    assert (error <= round_trip_bound(weight, qtype)).all()


def test_quantize_refuses_what_it_does_not_write():
    with pytest.raises(ValueError, match="quantize writes"):
        quantize(torch.randn(2, 256), QuantType.Q4_K)
    with pytest.raises(ValueError, match="float"):
        quantize(torch.ones(2, 32, dtype=torch.int32), QuantType.Q8_0)


def test_reference_is_the_dequantized_float_product():
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(5, 64, QuantType.Q4_1, gen)
    x = torch.randn(3, 64, generator=gen)
    expected = x @ dequantize(blocks, QuantType.Q4_1, 64).T
    assert torch.equal(reference_quantized_matmul(x, blocks, QuantType.Q4_1, 64), expected)
    with pytest.raises(ValueError, match=r"uint8 \[N, 40\]"):
        reference_quantized_matmul(x, blocks[:, :-1], QuantType.Q4_1, 64)


# ---------------------------------------------------------------- the native kernel

GRID = list(
    itertools.product(
        TYPES, (1, 7, 64), (1, 33, 256), (32, 256, 4096), (torch.float32, torch.bfloat16)
    )
)


def grid_id(case) -> str:
    qtype, m, n, k, dtype = case
    return f"{qtype.name}-M{m}-N{n}-K{k}-{str(dtype)[6:]}"


@needs_native
@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_native_matches_float_product(case):
    """K = 32 is a partial super-block for the k-quants: its bytes past k are ignored."""
    qtype, m, n, k, dtype = case
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    blocks = random_blocks(n, k, qtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = torch.empty(m, n, dtype=dtype)
    OPS.quantized_matmul(got, x, blocks, qtype, k)
    assert_matches_float(got, x, dequantize(blocks, qtype, k), qtype)


@needs_native
@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [40, 100, 136])
@pytest.mark.parametrize("m", [1, 7])
def test_native_partial_blocks_of_quantized_weights(qtype, k, m):
    """Rows of k not a multiple of 32, as `quantize` writes them (zero-padded)."""
    gen = torch.Generator().manual_seed(k + m)
    weight = torch.randn(33, k, generator=gen)
    blocks = quantize(weight, qtype)
    x = torch.randn(m, k, generator=gen)
    assert_matches_float(
        quantized_matmul(x, blocks, qtype, k), x, dequantize(blocks, qtype, k), qtype
    )


@needs_native
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_native_partial_super_block(qtype):
    gen = torch.Generator().manual_seed(int(qtype))
    blocks = random_blocks(9, 300, qtype, gen)
    x = torch.randn(5, 300, generator=gen)
    assert_matches_float(
        quantized_matmul(x, blocks, qtype, 300), x, dequantize(blocks, qtype, 300), qtype
    )


@needs_native
def test_native_handles_extreme_activations():
    """All-zero rows (scale 0), one huge value among tiny ones, and Q8_0's -128 byte
    (which no quantizer writes, but a file may hold)."""
    gen = torch.Generator().manual_seed(3)
    blocks = random_blocks(8, 128, QuantType.Q8_0, gen)
    blocks[:, 2:34] = 0x80  # int8 -128 everywhere in each row's first block
    x = torch.randn(3, 128, generator=gen) * 1e-3
    x[0] = 0.0
    x[1, 5] = 1e4
    got = quantized_matmul(x, blocks, QuantType.Q8_0, 128)
    assert (got[0] == 0).all()
    assert_matches_float(got, x, dequantize(blocks, QuantType.Q8_0, 128), QuantType.Q8_0)


@needs_native
def test_native_writes_strided_rows():
    gen = torch.Generator().manual_seed(4)
    blocks = random_blocks(33, 256, QuantType.Q4_K, gen)
    x = torch.randn(5, 300, generator=gen)[:, 10:266]  # rows 300 apart
    out = torch.full((5, 40), float("nan"))[:, :33]
    OPS.quantized_matmul(out, x, blocks, QuantType.Q4_K, 256)
    assert torch.equal(out, quantized_matmul(x.contiguous(), blocks, QuantType.Q4_K, 256))
    assert torch.isnan(out.as_strided((5, 7), (40, 1), 33)).all()  # the columns beside


@needs_native
@pytest.mark.parametrize("method", list(Method), ids=lambda m: m.name)
@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q6_K], ids=lambda t: t.name)
def test_native_empty_shapes(qtype, method):
    if method == Method.ONEDNN_PANELS and not torch.backends.mkldnn.is_available():
        pytest.skip("torch was built without oneDNN")
    no_rows = torch.zeros(0, row_bytes(qtype, 256), dtype=torch.uint8)
    got = quantized_matmul(torch.randn(3, 256), no_rows, qtype, 256, levels=method)
    assert got.shape == (3, 0)
    blocks = random_blocks(5, 256, qtype, torch.Generator().manual_seed(0))
    got = quantized_matmul(torch.randn(0, 256), blocks, qtype, 256, levels=method)
    assert got.shape == (0, 5)


@needs_native
def test_every_type_runs_natively():
    assert all(supported_natively(t) for t in TYPES)


@needs_native
def test_native_checks_its_arguments():
    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks(4, 64, QuantType.Q4_0, gen)
    x = torch.randn(2, 64)
    out = torch.empty(2, 4)
    cases = [
        ({"qtype": 1}, "qtype must be a ggml type id"),  # F16: not a block type
        ({"k": 65}, r"x must be \[M, 65\]"),
        ({"blocks": blocks[:, :-2]}, r"blocks must be uint8 \[N, 36\]"),
        ({"blocks": blocks.view(torch.int8)}, "blocks must be uint8"),
        ({"blocks": torch.cat([blocks, blocks], dim=1)[:, :36]}, "contiguous"),
        ({"x": x.to(torch.float16)}, "float32 or bfloat16"),
        ({"out": torch.empty(2, 5)}, r"out must be \[2, 4\]"),
        ({"out": torch.empty(2, 4, dtype=torch.bfloat16)}, r"out must be \[2, 4\] torch.float32"),
    ]
    for change, message in cases:
        args = {"out": out, "x": x, "blocks": blocks, "qtype": QuantType.Q4_0, "k": 64} | change
        with pytest.raises(ValueError, match=message):
            OPS.quantized_matmul(**args)
    # The kernel itself refuses wrong structure (callers of OPS.unchecked).
    with pytest.raises(ValueError, match="quantized_matmul"):
        OPS.unchecked.quantized_matmul(out, x, blocks[:, :-2], int(QuantType.Q4_0), 64)
    with pytest.raises(ValueError, match="qtype 1 is not supported"):
        OPS.unchecked.quantized_matmul(out, x, blocks, 1, 64)


# ---------------------------------------------------------------- GGUF files


@needs_native
def test_gguf_file_of_every_type(tmp_path):
    """Writes one tensor of each type into a GGUF file (raw quantized bytes), reads it
    back, and multiplies by the bytes as read."""
    gen = torch.Generator().manual_seed(6)
    n, k = 48, 512
    written = {}
    writer = gguf.GGUFWriter(str(tmp_path / "quantized.gguf"), "llama")
    for qtype in TYPES:
        if qtype in QUANTIZABLE:  # the 32-element types that we write from floats
            blocks = quantize(torch.randn(n, k, generator=gen) * 0.05, qtype)
        else:
            blocks = random_blocks(n, k, qtype, gen)
        written[qtype.name] = blocks
        writer.add_tensor(qtype.name, blocks.numpy(), raw_dtype=gguf_type(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "quantized.gguf")).tensors}
    assert set(tensors) == {t.name for t in TYPES}
    x = torch.randn(3, k, generator=gen)
    for qtype in TYPES:
        tensor = tensors[qtype.name]
        assert tensor.tensor_type == gguf_type(qtype)
        assert list(tensor.shape) == [k, n]  # ggml's order: the row length first
        blocks = torch.from_numpy(np.array(tensor.data)).reshape(n, row_bytes(qtype, k))
        assert torch.equal(blocks, written[qtype.name])
        got = quantized_matmul(x, blocks, qtype, k)
        assert_matches_float(got, x, dequantize(blocks, qtype, k), qtype)


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7])
def test_one_level_rounds_activations_once(qtype, m):
    """levels=1 (llama.cpp's scheme): the single rounding, emulated exactly; two levels
    come within the second rounding's much smaller bound of the float product."""
    k = 512
    gen = torch.Generator().manual_seed(7 * m + int(qtype))
    blocks = random_blocks(33, k, qtype, gen)
    x = torch.randn(m, k, generator=gen)
    w = dequantize(blocks, qtype, k)
    one = quantized_matmul(x, blocks, qtype, k, levels=1)
    assert_matches_float(one, x, w, qtype, levels=1)
    two = quantized_matmul(x, blocks, qtype, k, levels=2)
    exact = x.double() @ w.double().T
    assert (two.double() - exact).abs().max() < (one.double() - exact).abs().max() / 20


# ---------------------------------------------------------------- float panels

PANELS = [Method.MM_PANELS] + (
    [Method.ONEDNN_PANELS] if torch.backends.mkldnn.is_available() else []
)


@needs_native
@pytest.mark.parametrize("method", PANELS, ids=lambda m: m.name)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_panels_decode_every_value_exactly(qtype, method):
    """x = I: each output is one weight value times 1, so out = W.T as the panels decode
    it, against the reference dequantizer: equal up to a fused multiply-add's last bit
    (d * q + m rounded once instead of twice). k = 300 ends in a partial block."""
    k = 300
    blocks = random_blocks(70, k, qtype, torch.Generator().manual_seed(int(qtype)))
    w = dequantize(blocks, qtype, k)  # [70, k]
    got = quantized_matmul(torch.eye(k), blocks, qtype, k, levels=method)  # [k, 70]
    torch.testing.assert_close(got, w.T, rtol=2.0**-23, atol=2.0**-24 * w.abs().max().item())


@needs_native
@pytest.mark.parametrize("method", PANELS, ids=lambda m: m.name)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 33, 256), (64, 256, 576), (17, 1000, 4096)])
def test_panels_equal_the_float_product(qtype, method, dtype, m, n, k):
    """No activation rounding: the float product within float32 sums (bfloat16 outputs:
    their one rounding). 1000 x 4096 spans several panels per thread, the last shorter."""
    gen = torch.Generator().manual_seed(m + n + k + int(qtype))
    blocks = random_blocks(n, k, qtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = dequantize(blocks, qtype, k)
    got = quantized_matmul(x, blocks, qtype, k, levels=method)
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # sum |x| |w|: the sums' error scale
    rtol = BF16_RTOL if dtype == torch.bfloat16 else FLOAT_SUM_RTOL
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= rtol * (exact.abs() + scale / 100) + 1e-6 * scale).all()


@needs_native
@pytest.mark.parametrize("method", PANELS, ids=lambda m: m.name)
def test_panels_write_strided_rows_and_take_strided_activations(method):
    gen = torch.Generator().manual_seed(8)
    blocks = random_blocks(33, 256, QuantType.Q4_K, gen)
    x = torch.randn(40, 300, generator=gen)[:, 10:266]  # rows 300 apart
    out = torch.full((40, 40), float("nan"))[:, :33]
    OPS.quantized_matmul(out, x, blocks, QuantType.Q4_K, 256, method)
    expected = quantized_matmul(x.contiguous(), blocks, QuantType.Q4_K, 256, levels=method)
    assert torch.equal(out, expected)
    assert torch.isnan(out.as_strided((40, 7), (40, 1), 33)).all()  # the columns beside


@needs_native
def test_panels_in_inference_mode_and_on_one_thread():
    """torch's inference mode is per thread: the panels' GEMMs run on OpenMP threads
    that must take the caller's (an inference tensor written in place otherwise fails)."""
    gen = torch.Generator().manual_seed(9)
    blocks = random_blocks(300, 128, QuantType.Q8_0, gen)
    x = torch.randn(48, 128, generator=gen)
    expected = quantized_matmul(x, blocks, QuantType.Q8_0, 128, levels=PANELS[-1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            got = quantized_matmul(x, blocks, QuantType.Q8_0, 128, levels=PANELS[-1])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, expected)


def test_pick_method_integer_for_few_rows_panels_for_many():
    assert pick_method(1, 576, onednn=True) == Method.ROUNDED_TWICE
    assert pick_method(15, 576, onednn=True) == Method.ROUNDED_TWICE
    assert pick_method(16, 576, onednn=True) == Method.ONEDNN_PANELS
    assert pick_method(31, 4096, onednn=True) == Method.ROUNDED_TWICE
    assert pick_method(32, 4096, onednn=True) == Method.ONEDNN_PANELS
    assert pick_method(23, 576, onednn=False) == Method.ROUNDED_TWICE
    assert pick_method(24, 576, onednn=False) == Method.MM_PANELS
    assert pick_method(1023, 4096, onednn=False) == Method.ROUNDED_TWICE
    assert pick_method(2048, 14336, onednn=False) == Method.MM_PANELS


@needs_native
def test_native_refuses_an_unknown_method():
    blocks = random_blocks(4, 64, QuantType.Q4_0, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="levels must be -1, 0, 1 or 2"):
        OPS.quantized_matmul(torch.empty(2, 4), torch.randn(2, 64), blocks, QuantType.Q4_0, 64, 3)
    with pytest.raises(ValueError, match="levels must be -1, 0, 1 or 2"):
        OPS.unchecked.quantized_matmul(torch.empty(2, 4), torch.randn(2, 64), blocks, 2, 64, -2)
