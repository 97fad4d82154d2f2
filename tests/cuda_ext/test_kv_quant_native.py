"""The native CPU kernels over 8-bit KV caches (cuda_ext/kv_quant.py's format): rows
written bit for bit as `quantize_rows` writes them, attention over them equal to the
reference over the dequantized cache, block copies carrying the scales, and the argument
checks. The float cache (kv_format 0) is tests/cuda_ext/test_native_cpu.py's."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from cuda_ext import reference
from cuda_ext.kv_quant import KVRowCode, dequantize_rows, quantize_rows, row_width
from tests.cuda_ext.attention_cases import (
    Features,
    PagedCaches,
    random_query,
    shuffled_block_tables,
    torch_threads,
)
from tests.cuda_ext.native_ops import native_cpu_ops_or_skip

pytestmark = pytest.mark.timeout(120)

OPS = native_cpu_ops_or_skip()

CODES = tuple(KVRowCode)
DTYPES = (torch.float32, torch.bfloat16)
HEAD_SIZES = (64, 128, 44)  # 44: the generic path, with a tail under AVX-512 and AVX2
BLOCK_SIZES = (8, 16, 32)
HEADS = ((2, 2), (9, 3), (8, 2))  # (num_heads, num_kv_heads): GQA 1, 3 and 4
NAN_SCALE = torch.tensor([float("nan")]).view(torch.uint8)  # a scale no written row has


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:  # both round float32 math to bfloat16 once; they may land one step apart
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1.6e-2)


def random_rows(shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor:
    """[..., head_size] float32 rows of varied magnitudes (so scales differ), one in ten
    all zero (scale 0)."""
    magnitude = torch.empty(*shape[:-1], 1).uniform_(0.05, 8.0, generator=rng)
    rows = torch.randn(shape, generator=rng) * magnitude
    zero = torch.rand(*shape[:-1], 1, generator=rng) < 0.1
    return rows.masked_fill(zero, 0.0)


class QuantizedContexts(PagedCaches):
    """Random K/V for sequences of the given lengths, coded into 8-bit rows and paged into
    shuffled blocks.

    Later sequences share their first blocks with sequence 0 (a common prefix); block
    tables are int32 or int64 with garbage past each context; rows no sequence uses
    have a NaN scale, so reading outside a context shows up in the output.
    `key_cache` / `value_cache` are uint8 in the house (token-major) layout;
    `native_caches()` gives them head-major, as the kernels take them; `reference()`
    attends over their dequantized values.
    """

    def __init__(self, seq_lens, block_size, num_kv_heads, head_size, code, rng, *, index):
        self.seq_lens, self.code = list(seq_lens), code
        self.block_tables, num_blocks = shuffled_block_tables(self.seq_lens, block_size, rng, index)
        shape = (num_blocks, block_size, num_kv_heads, row_width(head_size))
        self.key_cache, self.value_cache = torch.zeros(shape, dtype=torch.uint8), None
        self.key_cache[..., head_size:] = NAN_SCALE
        self.value_cache = self.key_cache.clone()
        written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, length in enumerate(self.seq_lens):
            slots = self.slots(i, length)
            fresh = slots[~written[slots]]  # a shared block holds one sequence's rows
            written[fresh] = True
            for cache in (self.key_cache, self.value_cache):
                rows = random_rows((len(fresh), num_kv_heads, head_size), rng)
                cache.view(-1, num_kv_heads, shape[-1])[fresh] = quantize_rows(rows, code)

    def reference(self, query, query_lens, scale, features=None):
        key, value = (dequantize_rows(c, self.code) for c in (self.key_cache, self.value_cache))
        return reference.paged_attention_reference(
            query, key, value, self.block_tables.long(), query_lens, self.seq_lens, scale,
            **(features or {}),
        )  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One attention test case over 8-bit caches."""

    code: KVRowCode
    dtype: torch.dtype
    head_size: int
    block_size: int
    heads: tuple[int, int]  # (num_heads, num_kv_heads)
    seed: int
    index: torch.dtype = torch.int64
    features: Features = Features()

    def contexts(self, seq_lens, rng) -> QuantizedContexts:
        return QuantizedContexts(
            seq_lens, self.block_size, self.heads[1], self.head_size, self.code, rng,
            index=self.index,
        )  # fmt: skip


def run_decode(case: Case, seq_lens) -> None:
    rng = torch.Generator().manual_seed(case.seed)
    ctx = case.contexts(seq_lens, rng)
    query = random_query(len(seq_lens), case.heads[0], case.head_size, case.dtype, rng)
    extra = case.features.arguments(case.heads[0], rng)
    out = torch.full_like(query, float("nan"))
    scale = case.head_size**-0.5
    OPS.paged_attention_decode(
        out, query, *ctx.native_caches(), ctx.block_tables, ctx.seq_lens_tensor(), scale,
        **extra, kv_format=case.code,
    )  # fmt: skip
    assert_close(out, ctx.reference(query, [1] * len(seq_lens), scale, extra))


def run_prefill(case: Case, prefixes, query_lens) -> None:
    rng = torch.Generator().manual_seed(case.seed)
    ctx = case.contexts([p + q for p, q in zip(prefixes, query_lens, strict=True)], rng)
    query = random_query(sum(query_lens), case.heads[0], case.head_size, case.dtype, rng)
    extra = case.features.arguments(case.heads[0], rng)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int64)
    scale = case.head_size**-0.5
    OPS.paged_attention_prefill(
        out, query, *ctx.native_caches(), ctx.block_tables, starts, ctx.seq_lens_tensor(),
        scale, **extra, kv_format=case.code,
    )  # fmt: skip
    assert_close(out, ctx.reference(query, query_lens, scale, extra))


# -- reshape_and_cache ----------------------------------------------------------------


def special_rows(head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[5, head_size]: an all-zero row, a row of large values, a row of tiny ones, a row
    whose values land halfway between int8 codes (amax 127: scaled by exactly 1), and a
    row of denormals (amax under FLT_MIN: coded as zeros, its inverse would overflow)."""
    rows = torch.zeros(5, head_size)
    rows[1] = torch.linspace(-1.0, 1 / 3, head_size) * 3e38
    rows[2] = torch.linspace(-1e-30, 3e-31, head_size)
    rows[3, 0] = 127.0
    rows[3, 1:] = torch.arange(1, head_size) % 9 - 4.5
    rows[4] = torch.linspace(-1e-39, 3e-40, head_size)
    return rows.to(dtype)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_quantize_rows_bit_for_bit(code, dtype):
    rng = torch.Generator().manual_seed(int(code))
    num_tokens, kv_heads, head_size, block_size, num_blocks = 29, 2, 44, 8, 6
    qkv = random_rows((num_tokens, 3 + 2 * kv_heads, head_size), rng).to(dtype)
    key, value = qkv[:, 3 : 3 + kv_heads], qkv[:, 3 + kv_heads :]  # strided views
    key[:5, 0], value[5:9, 1] = special_rows(head_size, dtype), 0.0
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[[2, 11]] = -1  # padding
    shape = (num_blocks, kv_heads, block_size, row_width(head_size))  # head-major
    caches = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=rng) for _ in "kv"]
    expected = [c.clone() for c in caches]
    OPS.reshape_and_cache(key, value, *caches, slots, kv_format=code)
    keep = slots >= 0
    block, offset = slots[keep] // block_size, slots[keep] % block_size
    for want, rows in zip(expected, (key, value), strict=True):
        want[block, :, offset] = quantize_rows(rows[keep], code)
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(cache, want)


# -- decode and prefill ---------------------------------------------------------------

# Every code x dtype x head size, each with a block size and head grouping taken in turn.
CASES = [
    Case(code, dtype, head, BLOCK_SIZES[i % 3], HEADS[(i + i // 3) % 3], seed=i,
         index=(torch.int32, torch.int64)[i % 2])
    for i, (code, dtype, head) in enumerate(itertools.product(CODES, DTYPES, HEAD_SIZES))
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_over_8bit_caches_matches_reference_over_dequantized(case):
    rnd = random.Random(case.seed)
    bs = case.block_size
    seq_lens = [1, 2, bs, bs + 1, rnd.randint(3, 300), rnd.randint(300, 700)]
    rnd.shuffle(seq_lens)
    run_decode(case, seq_lens)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_over_8bit_caches_matches_reference_over_dequantized(case):
    rnd = random.Random(case.seed)
    # Fresh prompts longer than a tile, chunks after a cached prefix, a decode-like
    # single token, and a chunk ending on a block boundary.
    pairs = [(0, 1), (0, 45), (150, 23), (rnd.randint(1, 200), 1)]
    pairs += [(case.block_size, case.block_size), (rnd.randint(0, 200), rnd.randint(1, 40))]
    rnd.shuffle(pairs)
    prefixes, query_lens = zip(*pairs, strict=True)
    run_prefill(case, list(prefixes), list(query_lens))


@pytest.mark.parametrize("code", CODES)
def test_decode_over_8bit_caches_partitioned_on_long_contexts(code):
    """Few (sequence, KV head) tasks and contexts over 512 tokens: the split-and-merge
    path, with and without a window, a cap and sinks."""
    with torch_threads(2):
        for i, features in enumerate((Features(), Features(700, 20.0, True))):
            for dtype, head_size in ((torch.float32, 64), (torch.bfloat16, 44)):
                case = Case(code, dtype, head_size, 16, (4, 1), seed=i, features=features)
                run_decode(case, [1500])
                run_decode(Case(code, dtype, head_size, 16, (6, 2), seed=i + 2), [2100, 600])


FEATURES = {
    "window5": Features(sliding_window=5),
    "window17": Features(sliding_window=17),
    "soft-cap": Features(soft_cap=2.0),
    "sinks": Features(sinks=True),
    "all": Features(sliding_window=17, soft_cap=30.0, sinks=True),
}


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("code", CODES)
def test_window_cap_and_sinks_over_8bit_caches_match_reference(name, code):
    i = list(FEATURES).index(name) + 5 * int(code)
    case = Case(
        code, DTYPES[i % 2], (64, 44, 128)[i % 3], BLOCK_SIZES[i % 3], HEADS[(i + 1) % 3],
        seed=i, features=FEATURES[name],
    )  # fmt: skip
    run_decode(case, [1, 2, case.block_size + 1, 17, 18, 240])
    run_prefill(case, [0, 40, 100, 7], [30, 1, 25, 9])


def test_a_float_cache_is_kv_format_0():
    """kv_format=0 is the float cache, exactly as without the argument."""
    rng = torch.Generator().manual_seed(5)
    caches = [torch.randn(6, 2, 8, 64, generator=rng) for _ in "kv"]
    tables, lens = torch.tensor([[3, 1, 4], [0, 5, 2]]), torch.tensor([20, 9])
    query = torch.randn(2, 4, 64, generator=rng)
    outs = [torch.empty_like(query) for _ in range(4)]
    OPS.paged_attention_decode(outs[0], query, *caches, tables, lens, 0.1)
    OPS.paged_attention_decode(outs[1], query, *caches, tables, lens, 0.1, kv_format=0)
    starts = torch.tensor([0, 1, 2])
    OPS.paged_attention_prefill(outs[2], query, *caches, tables, starts, lens, 0.1)
    OPS.paged_attention_prefill(outs[3], query, *caches, tables, starts, lens, 0.1, kv_format=0)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
    written = [c.clone() for c in caches]
    key = torch.randn(2, 2, 64, generator=rng)
    OPS.reshape_and_cache(key, key, *caches, torch.tensor([3, 40]))
    OPS.reshape_and_cache(key, key, *written, torch.tensor([3, 40]), kv_format=0)
    assert all(torch.equal(a, b) for a, b in zip(caches, written, strict=True))


# -- copy_blocks, swap_blocks ---------------------------------------------------------


@pytest.mark.parametrize("code", CODES)
def test_copy_and_swap_move_8bit_blocks_with_their_scales(code):
    rng = torch.Generator().manual_seed(int(code))

    def cache(num_blocks):  # head-major [num_blocks, 2 KV heads, 4 slots, 64 + 4]
        return quantize_rows(random_rows((num_blocks, 2, 4, 64), rng), code)

    keys, values = [cache(8) for _ in range(2)], [cache(8) for _ in range(2)]
    before = [c.clone() for c in keys + values]
    OPS.copy_blocks(keys, values, torch.tensor([[0, 5], [3, 7], [3, 6]]))
    for now, was in zip(keys + values, before, strict=True):
        assert torch.equal(
            dequantize_rows(now[[5, 7, 6]], code), dequantize_rows(was[[0, 3, 3]], code)
        )
        assert torch.equal(now[[0, 1, 2, 3, 4]], was[[0, 1, 2, 3, 4]])
    swap = torch.zeros(3, *keys[0].shape[1:], dtype=torch.uint8)
    OPS.swap_blocks(keys[0], swap, torch.tensor([[7, 0], [2, 2]]))
    assert torch.equal(dequantize_rows(swap[[0, 2]], code), dequantize_rows(keys[0][[7, 2]], code))
    back = cache(8)
    OPS.swap_blocks(swap, back, torch.tensor([[0, 1]]))
    assert torch.equal(back[1], keys[0][7])


# -- argument checks ------------------------------------------------------------------


def decode_args(code=KVRowCode.INT8, **overrides):
    """Valid decode arguments over 8-bit caches (2 sequences, 4 heads over 2 KV heads,
    head 64), overridden."""
    rng = torch.Generator().manual_seed(0)
    ctx = QuantizedContexts([10, 20], 8, 2, 64, code, rng, index=torch.int64)
    query = torch.randn(2, 4, 64)
    key_cache, value_cache = ctx.native_caches()
    args = dict(
        out=torch.empty_like(query), query=query, key_cache=key_cache,
        value_cache=value_cache, block_tables=ctx.block_tables,
        seq_lens=ctx.seq_lens_tensor(), scale=0.125, kv_format=code,
    )  # fmt: skip
    args.update(overrides)
    return args


def test_decode_args_are_valid_before_being_broken():
    OPS.paged_attention_decode(**decode_args())
    OPS.paged_attention_decode(**decode_args(query=torch.randn(2, 4, 64).bfloat16(),
                                             out=torch.empty(2, 4, 64).bfloat16()))  # fmt: skip


@pytest.mark.parametrize(
    "override,message",
    [
        (lambda a: {"kv_format": 4}, "kv_format must be 0 \\(a float cache\\) or a KVRowCode"),
        (lambda a: {"kv_format": -1}, "kv_format must be 0"),
        (lambda a: {"kv_format": 1.0}, "kv_format must be 0"),
        (lambda a: {"kv_format": True}, "kv_format must be 0"),
        (
            lambda a: {
                "key_cache": torch.zeros(5, 2, 8, 68),
                "value_cache": torch.zeros(5, 2, 8, 68),
            },
            "key_cache must be uint8 .* for kv_format=1",
        ),
        (
            lambda a: {
                "key_cache": a["key_cache"][..., :66].clone(),
                "value_cache": a["value_cache"][..., :66].clone(),
            },
            "key_cache rows must be query's head_size \\+ 4 = 68 bytes",
        ),  # fmt: skip
        (lambda a: {"value_cache": a["value_cache"][:-1].clone()}, "value_cache must match"),
        (
            lambda a: {"query": a["query"].half(), "out": a["out"].half()},
            "query must be float32 or bfloat16 over 8-bit caches",
        ),
        (lambda a: {"out": a["out"].bfloat16()}, "out must be"),
        (lambda a: {"kv_format": 0}, "uint8, not supported on CPU: .*take kv_format 1, 2 or 3"),
        (lambda a: {"query": torch.randn(2, 3, 64)}, "query must be"),
    ],
)
def test_decode_rejects_bad_arguments_over_8bit_caches(override, message):
    args = decode_args()
    args.update(override(args))
    with pytest.raises(ValueError, match=message):
        OPS.paged_attention_decode(**args)


def test_prefill_checks_kv_format_too():
    args = decode_args(query_start_loc=torch.tensor([0, 1, 2]))
    OPS.paged_attention_prefill(**args)
    with pytest.raises(ValueError, match="kv_format must be 0"):
        OPS.paged_attention_prefill(**{**args, "kv_format": 9})
    with pytest.raises(ValueError, match="key_cache rows must be query's head_size"):
        OPS.paged_attention_prefill(**{**args, "query": torch.randn(2, 4, 60),
                                       "out": torch.empty(2, 4, 60)})  # fmt: skip


def test_reshape_and_cache_rejects_bad_arguments_over_8bit_caches():
    cache = torch.zeros(4, 3, 2, 12, dtype=torch.uint8)  # 4 blocks, 3 KV heads, rows 8 + 4
    key, slots = torch.randn(5, 3, 8), torch.arange(5)
    OPS.reshape_and_cache(key, key, cache, cache.clone(), slots, kv_format=3)
    with pytest.raises(ValueError, match="key must be float32 or bfloat16 over 8-bit caches"):
        OPS.reshape_and_cache(key.half(), key.half(), cache, cache.clone(), slots, kv_format=3)
    with pytest.raises(ValueError, match="key_cache rows must be key's head_size \\+ 4 = 12"):
        OPS.reshape_and_cache(key, key, cache[..., :10].clone(), cache[..., :10].clone(), slots,
                              kv_format=1)  # fmt: skip
    with pytest.raises(ValueError, match="key_cache must be uint8"):
        OPS.reshape_and_cache(key, key, cache.float(), cache.float(), slots, kv_format=2)
    with pytest.raises(ValueError, match="kv_format must be 0"):
        OPS.reshape_and_cache(key, key, cache, cache.clone(), slots, kv_format=5)
    with pytest.raises(ValueError, match="value must be"):
        OPS.reshape_and_cache(key, key.bfloat16(), cache, cache.clone(), slots, kv_format=1)


def test_the_kernels_check_kv_format_without_the_wrappers():
    module = OPS.unchecked
    args = decode_args()
    args.pop("kv_format")
    with pytest.raises(ValueError, match="kv_format must be 0 \\(float cache\\)"):
        module.paged_attention_decode(**args, kv_format=4)
    with pytest.raises(ValueError, match="out, query and caches must share a dtype"):
        module.paged_attention_decode(**args)  # 8-bit caches read as a float cache
    floats = {"key_cache": torch.zeros(5, 2, 8, 64), "value_cache": torch.zeros(5, 2, 8, 64)}
    with pytest.raises(ValueError, match="8-bit caches be uint8"):
        module.paged_attention_decode(**{**args, **floats}, kv_format=1)
    narrow = {k: args[k][..., :66].clone() for k in ("key_cache", "value_cache")}
    with pytest.raises(ValueError, match="head sizes or head counts disagree"):
        module.paged_attention_decode(**{**args, **narrow}, kv_format=2)
    starts = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="kv_format must be 0 \\(float cache\\)"):
        module.paged_attention_prefill(
            args["out"], args["query"], args["key_cache"], args["value_cache"],
            args["block_tables"], starts, args["seq_lens"], 0.1, kv_format=-1,
        )  # fmt: skip
    key = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="reshape_and_cache: 8-bit caches take float32"):
        module.reshape_and_cache(key.half(), key.half(), args["key_cache"], args["value_cache"],
                                 torch.arange(3), kv_format=1)  # fmt: skip
    with pytest.raises(ValueError, match="reshape_and_cache: kv_format must be 0"):
        module.reshape_and_cache(key, key, args["key_cache"], args["value_cache"],
                                 torch.arange(3), kv_format=4)  # fmt: skip
