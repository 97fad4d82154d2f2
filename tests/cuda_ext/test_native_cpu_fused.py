"""The native fused layer ops (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary)
against the pure-torch oracle (cuda_ext/reference.py), and their argument checks."""

from __future__ import annotations

import itertools

import pytest
import torch

from cuda_ext import reference
from tests.cuda_ext.native_ops import native_cpu_ops_or_skip

pytestmark = pytest.mark.timeout(300)

OPS = native_cpu_ops_or_skip()

DTYPES = (torch.float32, torch.bfloat16)
HIDDEN_SIZES = (576, 512, 64, 37, 8, 1)  # SmolLM2's, our 58M's, and tails of every length
ROW_COUNTS = (1, 2, 17, 64, 300)  # 300 x 576 runs on every thread, 1 x 8 on one
EPS = 1e-5
PAD = 5  # extra columns of a strided buffer, NaN: the kernels must neither read nor write them


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: a few ulps (summation order, fused multiply-add); bfloat16: one step,
    where the float32 results straddle a rounding boundary."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


def random_rows(rows: int, cols: int, dtype, gen, *, strided: bool, scale: float = 1.0):
    """[rows, cols] values; strided: a view into a wider buffer whose extra columns are NaN."""
    values = (torch.randn(rows, cols, generator=gen) * scale).to(dtype)
    if not strided:
        return values
    buffer = torch.full((rows, cols + PAD), float("nan"), dtype=dtype)
    buffer[:, :cols] = values
    return buffer[:, :cols]


def assert_pad_untouched(t: torch.Tensor) -> None:
    """The NaN columns beside a strided view are still NaN (nothing wrote past a row)."""
    if t.is_contiguous() or t.numel() == 0:
        return
    rows, cols = t.shape
    pad = t.as_strided((rows, PAD), (t.stride(0), 1), t.storage_offset() + cols)
    assert torch.isnan(pad.float()).all()


GRID = list(itertools.product(DTYPES, HIDDEN_SIZES, ROW_COUNTS, (False, True)))


def grid_id(case) -> str:
    dtype, d, rows, strided = case
    return f"{str(dtype)[6:]}-d{d}-rows{rows}{'-strided' if strided else ''}"


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_rms_norm_matches_reference(case):
    dtype, d, rows, strided = case
    gen = torch.Generator().manual_seed(d * 1000 + rows)
    x = random_rows(rows, d, dtype, gen, strided=strided, scale=3.0)
    weight = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    out = random_rows(rows, d, dtype, gen, strided=strided)
    OPS.rms_norm(out, x, weight, EPS)
    assert_close(out, reference.rms_norm(x, weight, EPS))
    assert_pad_untouched(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place(dtype):
    gen = torch.Generator().manual_seed(0)
    x = random_rows(64, 576, dtype, gen, strided=True)
    weight = torch.randn(576, generator=gen).to(dtype)
    expected = reference.rms_norm(x, weight, EPS)
    OPS.rms_norm(x, x, weight, EPS)
    assert_close(x, expected)


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_fused_add_rms_norm_matches_reference(case):
    dtype, d, rows, strided = case
    gen = torch.Generator().manual_seed(d * 1000 + rows + 1)
    x = random_rows(rows, d, dtype, gen, strided=strided)
    residual = random_rows(rows, d, dtype, gen, strided=not strided, scale=4.0)
    weight = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    OPS.fused_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # one rounded add
    assert_close(x, expected_out)
    assert_pad_untouched(x)
    assert_pad_untouched(residual)


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_silu_and_mul_matches_reference(case):
    dtype, d, rows, strided = case
    gen = torch.Generator().manual_seed(d * 1000 + rows + 2)
    gate_up = random_rows(rows, 2 * d, dtype, gen, strided=strided, scale=4.0)
    out = random_rows(rows, d, dtype, gen, strided=not strided)
    OPS.silu_and_mul(out, gate_up)
    assert_close(out, reference.silu_and_mul(gate_up))
    assert_pad_untouched(out)


ROTARY_HEADS = ((9, 3), (4, 4), (1, 1))  # (num_heads, num_kv_heads): SmolLM2's, MHA, one
ROTARY_HEAD_SIZES = (64, 128, 80, 6, 2)  # 80: 2.5 vectors a half; 6 and 2: tails only
MAX_POSITIONS = 512


def rotary_tables(head_size: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's [MAX_POSITIONS, head_size] cos and sin tables, angles twice."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(torch.arange(MAX_POSITIONS).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def fused_qkv(tokens, heads, kv_heads, head_size, dtype, gen):
    """q, k views into one [tokens, (heads + 2 kv_heads) * head_size] projection output,
    as LlamaAttention makes them (token stride > heads * head_size)."""
    sizes = (heads * head_size, kv_heads * head_size, kv_heads * head_size)
    qkv = torch.randn(tokens, sum(sizes), generator=gen).to(dtype)
    q, k, _ = qkv.split(sizes, dim=-1)
    return qkv, q.view(tokens, heads, head_size), k.view(tokens, kv_heads, head_size)


ROTARY_GRID = [
    (dtype, table_dtype, heads, head_size, tokens)
    for dtype, table_dtype in (
        (torch.float32,) * 2,
        (torch.bfloat16,) * 2,
        (torch.bfloat16, torch.float32),
    )  # fmt: skip
    for heads in ROTARY_HEADS
    for head_size in ROTARY_HEAD_SIZES
    for tokens in (1, 7, 300)
]


@pytest.mark.parametrize(
    "case",
    ROTARY_GRID,
    ids=lambda c: f"{str(c[0])[6:]}-table{str(c[1])[6:]}-h{c[2][0]}x{c[2][1]}-d{c[3]}-t{c[4]}",
)
def test_rotary_embedding_matches_reference(case):
    dtype, table_dtype, (heads, kv_heads), head_size, tokens = case
    gen = torch.Generator().manual_seed(head_size * 100 + tokens)
    qkv, query, key = fused_qkv(tokens, heads, kv_heads, head_size, dtype, gen)
    value_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    cos, sin = rotary_tables(head_size, table_dtype)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen)
    expected_q, expected_k = reference.rotary_embedding(positions, query, key, cos, sin)
    OPS.rotary_embedding(positions, query, key, cos, sin)
    assert_close(query, expected_q)
    assert_close(key, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], value_before)  # v untouched


def test_rotary_embedding_bfloat16_rounds_as_torch():
    """In bfloat16 the kernel rounds each product and sum as torch does: equal bits."""
    gen = torch.Generator().manual_seed(3)
    _, query, key = fused_qkv(64, 9, 3, 64, torch.bfloat16, gen)
    cos, sin = rotary_tables(64, torch.float32)
    positions = torch.randint(0, MAX_POSITIONS, (64,), generator=gen)
    expected_q, expected_k = reference.rotary_embedding(positions, query, key, cos, sin)
    OPS.rotary_embedding(positions, query, key, cos, sin)
    assert torch.equal(query, expected_q) and torch.equal(key, expected_k)


def test_empty_batches_are_no_ops():
    x = torch.empty(0, 64)
    weight = torch.ones(64)
    OPS.rms_norm(torch.empty(0, 64), x, weight, EPS)
    OPS.fused_add_rms_norm(x, torch.empty(0, 64), weight, EPS)
    OPS.silu_and_mul(torch.empty(0, 32), x)
    cos, sin = rotary_tables(8, torch.float32)
    OPS.rotary_embedding(torch.empty(0, dtype=torch.int64), torch.empty(0, 2, 8),
                         torch.empty(0, 1, 8), cos, sin)  # fmt: skip


def _rows(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


# (op, arguments, the argument the error must name)
BAD_NORM = [
    ("rms_norm", lambda: (_rows(4, 8), _rows(4, 8, 1), _rows(8), EPS), "x must be"),
    ("rms_norm", lambda: (_rows(4, 8), _rows(4, 8, dtype=torch.float16), _rows(8), EPS),
     "x must be"),
    ("rms_norm", lambda: (_rows(8, 4), _rows(4, 8).t(), _rows(4), EPS), "x must be"),
    ("rms_norm", lambda: (_rows(4, 7), _rows(4, 8), _rows(8), EPS), "out must be"),
    ("rms_norm", lambda: (_rows(4, 8, dtype=torch.bfloat16), _rows(4, 8), _rows(8), EPS),
     "out must be"),
    ("rms_norm", lambda: (_rows(1, 8).expand(4, 8), _rows(4, 8), _rows(8), EPS), "out must be"),
    ("rms_norm", lambda: (_rows(4, 8), _rows(4, 8), _rows(7), EPS), "weight must be"),
    ("rms_norm", lambda: (_rows(4, 8), _rows(4, 8), _rows(8, dtype=torch.bfloat16), EPS),
     "weight must be"),
    ("rms_norm", lambda: (_rows(4, 8), _rows(4, 8), _rows(16)[::2], EPS), "weight must be"),
    ("fused_add_rms_norm", lambda: (_rows(4, 8), _rows(4, 9), _rows(8), EPS),
     "residual must be"),
    ("fused_add_rms_norm", lambda: (_rows(1, 8).expand(4, 8), _rows(4, 8), _rows(8), EPS),
     "x must be"),
    ("fused_add_rms_norm", lambda: (lambda t: (t, t, _rows(8), EPS))(_rows(4, 8)),
     "residual must not be x"),
    ("fused_add_rms_norm", lambda: ([[0.0] * 8], _rows(1, 8), _rows(8), EPS), "x must be"),
]  # fmt: skip
BAD_SILU = [
    ("silu_and_mul", lambda: (_rows(4, 4), _rows(4, 7)), "gate_up must be"),
    ("silu_and_mul", lambda: (_rows(4, 4), _rows(4, 8, dtype=torch.float64)), "gate_up must be"),
    ("silu_and_mul", lambda: (_rows(4, 8), _rows(4, 8)), "out must be"),
    ("silu_and_mul", lambda: (_rows(4, 4, dtype=torch.bfloat16), _rows(4, 8)), "out must have"),
    ("silu_and_mul", lambda: (_rows(1, 4).expand(4, 4), _rows(4, 8)), "out must be"),
]
_POS = torch.zeros(3, dtype=torch.int64)
_COS = torch.zeros(16, 8)
BAD_ROTARY = [
    ("rotary_embedding", lambda: (_POS.int(), _rows(3, 2, 8), _rows(3, 1, 8), _COS, _COS),
     "positions must be"),
    ("rotary_embedding", lambda: (_POS, _rows(3, 16), _rows(3, 1, 8), _COS, _COS),
     "query must be"),
    ("rotary_embedding", lambda: (_POS, _rows(3, 2, 7), _rows(3, 1, 7), _COS[:, :7], _COS[:, :7]),
     "query must be"),
    ("rotary_embedding", lambda: (_POS, _rows(4, 2, 8), _rows(4, 1, 8), _COS, _COS),
     "query must be"),
    ("rotary_embedding", lambda: (_POS, _rows(3, 2, 8), _rows(3, 1, 4), _COS, _COS),
     "key must be"),
    ("rotary_embedding",
     lambda: (_POS, _rows(3, 2, 8), _rows(3, 1, 8, dtype=torch.bfloat16), _COS, _COS),
     "key must have"),
    ("rotary_embedding", lambda: (_POS, _rows(1, 2, 8).expand(3, 2, 8), _rows(3, 1, 8), _COS,
                                  _COS), "query must have unit last stride"),
    ("rotary_embedding", lambda: (_POS, _rows(3, 2, 8), _rows(3, 1, 8), _COS[:, :4], _COS),
     "cos must be"),
    ("rotary_embedding", lambda: (_POS, _rows(3, 2, 8), _rows(3, 1, 8), _COS, _COS.double()),
     "sin must be"),
    ("rotary_embedding",
     lambda: (_POS, _rows(3, 2, 8), _rows(3, 1, 8), _COS.bfloat16(), _COS.bfloat16()),
     "cos must be"),
    ("rotary_embedding",
     lambda: (torch.tensor([0, 16, 1]), _rows(3, 2, 8), _rows(3, 1, 8), _COS, _COS),
     r"positions\[1\] = 16 is outside the tables' 16 positions"),
    ("rotary_embedding",
     lambda: (torch.tensor([0, -1, 1]), _rows(3, 2, 8), _rows(3, 1, 8), _COS, _COS),
     r"positions\[1\] = -1"),
]  # fmt: skip


@pytest.mark.parametrize(
    "op, args, message",
    BAD_NORM + BAD_SILU + BAD_ROTARY,
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_arguments_raise_naming_the_argument(op, args, message):
    with pytest.raises(ValueError, match=message):
        getattr(OPS, op)(*args())


def test_unchecked_kernels_still_check_structure():
    """Callers of `OPS.unchecked` (the model's layer ops) get a ValueError on a wrong
    structure, not a wild read or write."""
    module = OPS.unchecked
    with pytest.raises(ValueError, match="rms_norm: x must be"):
        module.rms_norm(_rows(4, 8), _rows(4, 8, 2), _rows(8), EPS)
    with pytest.raises(ValueError, match="fused_add_rms_norm: weight must be"):
        module.fused_add_rms_norm(_rows(4, 8), _rows(4, 8), _rows(9), EPS)
    with pytest.raises(ValueError, match="silu_and_mul: out must be"):
        module.silu_and_mul(_rows(4, 5), _rows(4, 8))
    with pytest.raises(ValueError, match="rotary_embedding: query and key"):
        module.rotary_embedding(_POS, _rows(3, 2, 8), _rows(2, 1, 8), _COS, _COS)
    with pytest.raises(ValueError, match="rotary_embedding: cos and sin"):
        module.rotary_embedding(_POS, _rows(3, 2, 8), _rows(3, 1, 8), _COS[:, :4], _COS[:, :4])
    with pytest.raises(ValueError, match=r"rotary_embedding: positions\[2\] = 99 is outside"):
        module.rotary_embedding(
            torch.tensor([0, 1, 99]), _rows(3, 2, 8), _rows(3, 1, 8), _COS, _COS
        )
    with pytest.raises(ValueError, match="silu_and_mul: dtype Half is not supported"):
        module.silu_and_mul(_rows(4, 4, dtype=torch.half), _rows(4, 8, dtype=torch.half))
