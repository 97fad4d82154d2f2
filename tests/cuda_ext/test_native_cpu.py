"""The native CPU kernels against the pure-torch oracle (cuda_ext/reference.py), their
argument checks, and the loader that builds them."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cuda_ext import build, reference
from cuda_ext.build import load_cpu_ops
from cuda_ext.native_cpu import NativeCpuOps
from tests.cuda_ext.attention_cases import (
    NO_FEATURES,
    UNUSED_BLOCK,
    Features,
    PagedCaches,
    random_query,
    shuffled_block_tables,
    torch_threads,
)
from tests.cuda_ext.native_ops import native_cpu_ops_or_skip

pytestmark = pytest.mark.timeout(300)

OPS = native_cpu_ops_or_skip()

DTYPES = (torch.float32, torch.bfloat16)
HEAD_SIZES = (64, 80, 96, 128, 40, 72)  # the last two take the generic path
BLOCK_SIZES = (1, 8, 16, 32)
HEADS = ((4, 4), (8, 4), (8, 2), (4, 1))  # (num_heads, num_kv_heads): GQA 1, 2, 4 and MQA


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)
    else:  # both round float32 math to bfloat16 once; they may land one step apart
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1.6e-2)


class PagedContexts(PagedCaches):
    """Random K/V for sequences of the given lengths, paged into shuffled blocks.

    Later sequences share their first blocks with sequence 0 (a common prefix), block
    tables are int32 or int64 with garbage past each context, and cache slots no
    sequence uses hold NaN, so reading outside a context shows up in the output.
    `key_cache` / `value_cache` are in the house (token-major) layout the reference
    reads; `native_caches()` gives the same K/V head-major, as the kernels take them.
    """

    def __init__(self, seq_lens, block_size, num_kv_heads, head_size, dtype, rng, *, index):
        self.seq_lens = list(seq_lens)
        shape = (block_size, num_kv_heads, head_size)
        self.block_tables, num_blocks = shuffled_block_tables(self.seq_lens, block_size, rng, index)
        self.key_cache = torch.full((num_blocks, *shape), float("nan"), dtype=dtype)
        self.value_cache = torch.full((num_blocks, *shape), float("nan"), dtype=dtype)
        for i, length in enumerate(self.seq_lens):
            slots = self.slots(i, length)
            flat_k = self.key_cache.view(-1, num_kv_heads, head_size)
            flat_v = self.value_cache.view(-1, num_kv_heads, head_size)
            # A shared block holds the same values for every sequence that reads it.
            fresh = torch.isnan(flat_k[slots, 0, 0].float())
            kv_shape = (int(fresh.sum()), num_kv_heads, head_size)
            flat_k[slots[fresh]] = torch.randn(kv_shape, generator=rng).to(dtype)
            flat_v[slots[fresh]] = torch.randn(kv_shape, generator=rng).to(dtype)

    def reference(self, query, query_lens, scale, features=None):
        return reference.paged_attention_reference(
            query, self.key_cache, self.value_cache, self.block_tables.long(), query_lens,
            self.seq_lens, scale, **(features or {}),
        )  # fmt: skip


def run_decode(
    seq_lens, dtype, head_size, block_size, heads, seed, index=torch.int32, features=NO_FEATURES
):
    num_heads, num_kv_heads = heads
    rng = torch.Generator().manual_seed(seed)
    ctx = PagedContexts(seq_lens, block_size, num_kv_heads, head_size, dtype, rng, index=index)
    query = random_query(len(seq_lens), num_heads, head_size, dtype, rng)
    extra = features.arguments(num_heads, rng)
    out = torch.full_like(query, float("nan"))
    scale = head_size**-0.5
    OPS.paged_attention_decode(
        out, query, *ctx.native_caches(), ctx.block_tables, ctx.seq_lens_tensor(), scale, **extra
    )
    assert_close(out, ctx.reference(query, [1] * len(seq_lens), scale, extra))


# -- decode ---------------------------------------------------------------------------

# Every dtype x head size, each with a block size and head grouping taken in turn, so
# every value of each axis appears without the full product.
DECODE_CASES = [
    (dtype, head, BLOCK_SIZES[i % 4], HEADS[(i + i // 4) % 4], i)
    for i, (dtype, head) in enumerate(itertools.product(DTYPES, HEAD_SIZES * 2))
]


@pytest.mark.parametrize("dtype,head_size,block_size,heads,seed", DECODE_CASES)
def test_decode_matches_reference_on_ragged_batches(dtype, head_size, block_size, heads, seed):
    rnd = random.Random(seed)
    seq_lens = [1, 2, block_size, block_size + 1, rnd.randint(3, 300), rnd.randint(300, 1200)]
    if seed % 3 == 0:
        seq_lens.append(4096)
    rnd.shuffle(seq_lens)
    index = torch.int64 if seed % 2 else torch.int32
    run_decode(seq_lens, dtype, head_size, block_size, heads, seed, index=index)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "seq_lens,heads",
    [([4096], (4, 1)), ([4096, 513], (8, 2)), ([1500, 7, 600], (4, 1)), ([2049], (2, 2))],
)
def test_decode_partitioned_long_contexts(seq_lens, heads, threads):
    """Few (sequence, KV head) tasks and long contexts: the split-and-merge path."""
    with torch_threads(threads):
        for dtype, head_size in ((torch.float32, 128), (torch.bfloat16, 72)):
            run_decode(seq_lens, dtype, head_size, 16, heads, seed=len(seq_lens) + threads)


def test_decode_many_sequences_on_two_threads():
    rnd = random.Random(7)
    seq_lens = [rnd.choice([1, 5, 16, 17, 100, 700]) for _ in range(40)]
    with torch_threads(2):
        run_decode(seq_lens, torch.float32, 64, 16, (8, 2), seed=7)


def test_decode_reads_strided_query_and_writes_strided_out():
    rng = torch.Generator().manual_seed(3)
    ctx = PagedContexts([40, 9], 8, 2, 64, torch.float32, rng, index=torch.int64)
    qkv = torch.randn(2, 4 + 2 * 2, 64, generator=rng)  # fused projection output
    query = qkv[:, :4]
    out_buffer = torch.zeros(2, 6, 64)
    out = out_buffer[:, 1:5]
    OPS.paged_attention_decode(
        out, query, *ctx.native_caches(), ctx.block_tables, ctx.seq_lens_tensor(), 0.1
    )
    assert_close(out, ctx.reference(query, [1, 1], 0.1))
    assert out_buffer[:, 0].count_nonzero() == 0 and out_buffer[:, 5].count_nonzero() == 0


# -- prefill --------------------------------------------------------------------------

PREFILL_CASES = [
    (dtype, head, BLOCK_SIZES[(i + 1) % 4], HEADS[(i + i // 4 + 1) % 4], 100 + i)
    for i, (dtype, head) in enumerate(itertools.product(DTYPES, HEAD_SIZES))
]


def run_prefill(
    prefixes, query_lens, dtype, head_size, block_size, heads, seed, features=NO_FEATURES
):
    num_heads, num_kv_heads = heads
    rng = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefixes, query_lens, strict=True)]
    ctx = PagedContexts(
        seq_lens, block_size, num_kv_heads, head_size, dtype, rng, index=torch.int64
    )
    query = random_query(sum(query_lens), num_heads, head_size, dtype, rng)
    extra = features.arguments(num_heads, rng)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int64)
    scale = head_size**-0.5
    OPS.paged_attention_prefill(
        out, query, *ctx.native_caches(), ctx.block_tables, starts, ctx.seq_lens_tensor(),
        scale, **extra,
    )  # fmt: skip
    assert_close(out, ctx.reference(query, query_lens, scale, extra))


@pytest.mark.parametrize("dtype,head_size,block_size,heads,seed", PREFILL_CASES)
def test_prefill_matches_reference_on_mixed_chunks(dtype, head_size, block_size, heads, seed):
    rnd = random.Random(seed)
    # Fresh prompts, chunks after a cached prefix, single-token rows (decodes), and one
    # chunk that ends exactly on a block boundary.
    pairs = [(0, 1), (0, 64), (300, 37), (rnd.randint(1, 300), 1), (block_size, block_size)]
    pairs += [(rnd.randint(0, 300), rnd.randint(1, 64)) for _ in range(3)]
    rnd.shuffle(pairs)
    prefixes, query_lens = zip(*pairs, strict=True)
    run_prefill(list(prefixes), list(query_lens), dtype, head_size, block_size, heads, seed)


def test_prefill_every_query_length_up_to_64_on_two_threads():
    rnd = random.Random(11)
    query_lens = list(range(1, 65))
    prefixes = [rnd.randint(0, 300) for _ in query_lens]
    with torch_threads(2):
        run_prefill(prefixes, query_lens, torch.float32, 64, 16, (8, 4), seed=11)


def test_prefill_skips_sequences_without_query_tokens():
    run_prefill([5, 20, 0], [3, 0, 2], torch.float32, 64, 8, (4, 2), seed=5)


def test_prefill_with_one_token_per_sequence_equals_decode():
    rng = torch.Generator().manual_seed(9)
    ctx = PagedContexts([33, 1, 70], 16, 2, 96, torch.bfloat16, rng, index=torch.int32)
    query = random_query(3, 8, 96, torch.bfloat16, rng)
    decoded, prefilled = torch.empty_like(query), torch.empty_like(query)
    lens = ctx.seq_lens_tensor()
    args = (*ctx.native_caches(), ctx.block_tables)
    OPS.paged_attention_decode(decoded, query, *args, lens, 0.1)
    OPS.paged_attention_prefill(prefilled, query, *args, torch.arange(4), lens, 0.1)
    assert torch.equal(decoded, prefilled)


# -- sliding window, soft cap, sinks --------------------------------------------------

FEATURES = {
    "window1": Features(sliding_window=1),
    "window5": Features(sliding_window=5),
    "window17": Features(sliding_window=17),
    "window-past-context": Features(sliding_window=5000),
    "soft-cap": Features(soft_cap=2.0),
    "sinks": Features(sinks=True),
    "all": Features(sliding_window=17, soft_cap=30.0, sinks=True),
}
GROUPED_HEADS = ((2, 2), (8, 2), (8, 1))  # (num_heads, num_kv_heads): GQA groups 1, 4, 8
# Every feature x block size x group x dtype; head sizes alternate specialized / generic.
FEATURE_CASES = [
    (name, block_size, heads, dtype, (64, 72)[i % 2], i)
    for i, (name, block_size, heads, dtype) in enumerate(
        itertools.product(FEATURES, (1, 16, 32), GROUPED_HEADS, DTYPES)
    )
]


@pytest.mark.parametrize("name,block_size,heads,dtype,head_size,seed", FEATURE_CASES)
def test_decode_with_window_cap_and_sinks_matches_reference(
    name, block_size, heads, dtype, head_size, seed
):
    features = FEATURES[name]
    window = features.sliding_window or 17
    rnd = random.Random(seed)
    seq_lens = [
        1,
        2,
        block_size + 1,
        window,
        window + 1,
        rnd.randint(3, 300),
        rnd.randint(300, 1200),
    ]
    rnd.shuffle(seq_lens)
    run_decode(seq_lens, dtype, head_size, block_size, heads, seed, features=features)


@pytest.mark.parametrize("name,block_size,heads,dtype,head_size,seed", FEATURE_CASES)
def test_prefill_with_window_cap_and_sinks_matches_reference(
    name, block_size, heads, dtype, head_size, seed
):
    rnd = random.Random(seed)
    # Fresh prompts longer than a tile, chunks after a prefix longer than the window,
    # decode-like single tokens, and a chunk ending on a block boundary.
    pairs = [(0, 1), (0, 64), (300, 37), (rnd.randint(1, 300), 1), (block_size, block_size)]
    pairs += [(rnd.randint(0, 300), rnd.randint(1, 64)) for _ in range(2)]
    rnd.shuffle(pairs)
    prefixes, query_lens = zip(*pairs, strict=True)
    run_prefill(
        list(prefixes), list(query_lens), dtype, head_size, block_size, heads, seed,
        features=FEATURES[name],
    )  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [100, 700, 3000, 5000])
def test_decode_partitioned_with_window_cap_and_sinks(window, threads):
    """Few tasks and long contexts: the split-and-merge path over each window (its
    partitions start at the window), sinks joining the merge."""
    features = Features(sliding_window=window, soft_cap=20.0, sinks=True)
    with torch_threads(threads):
        for seq_lens, heads in (([4096], (8, 1)), ([4096, 513], (8, 2))):
            for dtype, head_size in ((torch.float32, 128), (torch.bfloat16, 72)):
                run_decode(seq_lens, dtype, head_size, 16, heads, window, features=features)


def test_large_sink_logits_stay_finite():
    """Sinks far above and below every logit: exp(sink) alone would overflow; the kernels
    take the sink into the running max."""
    rng = torch.Generator().manual_seed(4)
    ctx = PagedContexts([3000, 40], 16, 2, 64, torch.float32, rng, index=torch.int64)
    query = random_query(2, 4, 64, torch.float32, rng)
    sinks = torch.tensor([100.0, -100.0, 0.0, 30.0])
    lens = ctx.seq_lens_tensor()
    args = (*ctx.native_caches(), ctx.block_tables)
    expected = ctx.reference(query, [1, 1], 0.125, dict(sinks=sinks))
    for threads in (1, 2):  # 2: the partitioned decode
        with torch_threads(threads):
            decoded, prefilled = torch.empty_like(query), torch.empty_like(query)
            OPS.paged_attention_decode(decoded, query, *args, lens, 0.125, sinks=sinks)
            OPS.paged_attention_prefill(
                prefilled, query, *args, torch.arange(3), lens, 0.125, sinks=sinks
            )
        assert_close(decoded, expected)
        assert_close(prefilled, expected)
    assert decoded[:, 0].abs().max() < 1e-30  # the sink took all the weight


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [1, 5, 17, 40])
def test_blocks_before_every_window_are_never_read(block_size, window):
    """A block wholly before every query's window may be freed and reused (the hybrid
    allocator): pointing its table entry at a NaN block, or past the cache, changes
    nothing, for decodes and for prefill chunks after a prefix."""
    rng = torch.Generator().manual_seed(block_size * 100 + window)
    num_heads, num_kv_heads, head_size = 8, 2, 64
    decode_lens = [1, 40, 100, 300, 700]
    pairs = [(100, 1), (200, 37), (0, 90), (64, 64), (300, 5)]  # (prefix, query length)
    for decode in (True, False):
        query_lens = [1] * len(decode_lens) if decode else [q for _, q in pairs]
        seq_lens = decode_lens if decode else [p + q for p, q in pairs]
        ctx = PagedContexts(
            seq_lens, block_size, num_kv_heads, head_size, torch.float32, rng, index=torch.int64
        )
        query = random_query(sum(query_lens), num_heads, head_size, torch.float32, rng)
        extra = Features(sliding_window=window, soft_cap=5.0, sinks=True).arguments(num_heads, rng)
        key_cache, value_cache = ctx.native_caches()
        poison = key_cache.shape[0]  # a block of NaN, appended
        key_cache, value_cache = (
            torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (key_cache, value_cache)
        )
        poisoned = ctx.block_tables.clone()
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            unread = max(0, s_len - q_len - window + 1) // block_size
            poisoned[i, :unread] = poison if i % 2 else UNUSED_BLOCK
        assert (poisoned != ctx.block_tables).any()
        starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int64)
        outs = []
        for tables in (ctx.block_tables, poisoned):
            out = torch.full_like(query, float("nan"))
            lens = ctx.seq_lens_tensor()
            if decode:
                OPS.paged_attention_decode(
                    out, query, key_cache, value_cache, tables, lens, 0.125, **extra
                )
            else:
                OPS.paged_attention_prefill(
                    out, query, key_cache, value_cache, tables, starts, lens, 0.125, **extra
                )
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert_close(outs[1], ctx.reference(query, query_lens, 0.125, extra))


# -- reshape_and_cache, copy_blocks, swap_blocks --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_reference_with_strided_rows_and_padding(dtype):
    rng = torch.Generator().manual_seed(1)
    num_tokens, kv_heads, head_size, block_size, num_blocks = 37, 2, 72, 8, 12
    qkv = torch.randn(num_tokens, 4 + 2 * kv_heads, head_size, generator=rng).to(dtype)
    key, value = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[[0, 5, 36]] = -1  # padding
    expected = [torch.randn(num_blocks, block_size, kv_heads, head_size).to(dtype) for _ in "kv"]
    caches = [reference.head_major(c) for c in expected]
    OPS.reshape_and_cache(key, value, *caches, slots)
    reference.reshape_and_cache(key, value, *expected, slots)
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(reference.token_major(cache), want)


def test_reshape_and_cache_with_head_stride_unlike_head_size():
    key_buffer = torch.randn(5, 3, 16)
    key, value = key_buffer[:, :, :8], key_buffer[:, :, 8:]  # heads 16 apart, rows of 8
    caches = [torch.zeros(4, 3, 2, 8) for _ in "kv"]  # head-major: 4 blocks of 2 slots
    expected = [torch.zeros(4, 2, 3, 8) for _ in "kv"]
    slots = torch.tensor([7, 0, -1, 3, 4])
    OPS.reshape_and_cache(key, value, *caches, slots)
    reference.reshape_and_cache(key, value, *expected, slots)
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(reference.token_major(cache), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference_across_layers(dtype):
    shape = (10, 4, 2, 40)
    keys = [torch.randn(shape).to(dtype) for _ in range(3)]
    values = [torch.randn(shape).to(dtype) for _ in range(3)]
    expected = [c.clone() for c in keys + values]
    mapping = torch.tensor([[0, 5], [3, 7], [3, 9], [1, 2]])
    OPS.copy_blocks(keys, values, mapping)
    for cache in expected:
        reference.copy_blocks(cache, mapping[:, 0], mapping[:, 1])
    for actual, want in zip(keys + values, expected, strict=True):
        assert torch.equal(actual, want)


def test_copy_blocks_with_nothing_to_copy_changes_nothing():
    cache = torch.randn(3, 2, 1, 8)
    before = cache.clone()
    OPS.copy_blocks([cache], [cache.clone()], torch.empty(0, 2, dtype=torch.int64))
    OPS.copy_blocks([], [], torch.tensor([[0, 1]]))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_between_caches_of_different_sizes(dtype):
    device_cache = torch.randn(12, 8, 2, 64).to(dtype)
    swap_cache = torch.zeros(5, 8, 2, 64, dtype=dtype)
    out_mapping = torch.tensor([[11, 0], [3, 4], [6, 2]])
    OPS.swap_blocks(device_cache, swap_cache, out_mapping)
    expected = torch.zeros_like(swap_cache)
    reference.swap_blocks(device_cache, expected, out_mapping[:, 0], out_mapping[:, 1])
    assert torch.equal(swap_cache, expected)
    back = torch.zeros_like(device_cache)
    OPS.swap_blocks(swap_cache, back, out_mapping[:, [1, 0]].contiguous())
    assert torch.equal(back[[11, 3, 6]], device_cache[[11, 3, 6]])


# -- argument checks ------------------------------------------------------------------


def decode_args(**overrides):
    """Valid decode arguments (2 sequences, 4 heads over 2 KV heads, head 64), overridden."""
    rng = torch.Generator().manual_seed(0)
    ctx = PagedContexts([10, 20], 8, 2, 64, torch.float32, rng, index=torch.int64)
    query = torch.randn(2, 4, 64)
    key_cache, value_cache = ctx.native_caches()
    args = dict(
        out=torch.empty_like(query), query=query, key_cache=key_cache,
        value_cache=value_cache, block_tables=ctx.block_tables,
        seq_lens=ctx.seq_lens_tensor(), scale=0.125,
    )  # fmt: skip
    args.update(overrides)
    return args


def test_decode_args_are_valid_before_being_broken():
    OPS.paged_attention_decode(**decode_args())


@pytest.mark.parametrize(
    "override,message",
    [
        (lambda a: {"query": a["query"].bfloat16()}, "query must have the caches' dtype"),
        (
            lambda a: {k: a[k].half() for k in ("query", "out", "key_cache", "value_cache")},
            "float16, not supported on CPU",
        ),
        (lambda a: {"query": a["query"].to("meta")}, "query must be on the CPU"),
        (
            lambda a: {"key_cache": torch.zeros(*a["key_cache"].shape[:3], 128)[..., :64]},
            "key_cache must be contiguous",
        ),
        (lambda a: {"value_cache": a["value_cache"][:-1].clone()}, "value_cache must match"),
        (lambda a: {"out": a["out"][:1]}, "out must be"),
        (lambda a: {"query": torch.randn(2, 3, 64)}, "query must be"),
        (lambda a: {"query": torch.randn(2, 4, 32)}, "query must be"),
        (lambda a: {"seq_lens": a["seq_lens"][:1]}, "seq_lens must be contiguous int64"),
        (lambda a: {"seq_lens": a["seq_lens"].int()}, "seq_lens must be contiguous int64"),
        (lambda a: {"block_tables": a["block_tables"].float()}, "block_tables must be"),
        (lambda a: {"block_tables": a["block_tables"][:1]}, "block_tables must be"),
        (lambda a: {"seq_lens": torch.tensor([10, 9999])}, "needs .* blocks"),
        (lambda a: {"block_tables": a["block_tables"] * 0 + 99}, "is not a block of the cache"),
        (lambda a: {"seq_lens": torch.tensor([10, 0])}, "at least its own token"),
        (lambda a: {"sliding_window": -1}, "sliding_window must be >= 0"),
        (lambda a: {"sliding_window": 2.5}, "sliding_window must be an int"),
        (lambda a: {"soft_cap": -1.0}, "soft_cap must be finite and >= 0"),
        (lambda a: {"soft_cap": float("nan")}, "soft_cap must be finite and >= 0"),
        (lambda a: {"soft_cap": "50"}, "soft_cap must be a float"),
        (lambda a: {"sinks": torch.zeros(2)}, "sinks must be contiguous float32 \\[4\\]"),
        (lambda a: {"sinks": torch.zeros(4).bfloat16()}, "sinks must be contiguous float32"),
        (lambda a: {"sinks": torch.zeros(4, 2)[:, 0]}, "sinks must be contiguous float32"),
        (lambda a: {"sinks": torch.zeros(4).to("meta")}, "sinks must be on the CPU"),
    ],
)
def test_decode_rejects_bad_arguments(override, message):
    args = decode_args()
    args.update(override(args))
    with pytest.raises(ValueError, match=message):
        OPS.paged_attention_decode(**args)


def test_prefill_checks_its_features_too():
    args = decode_args(query_start_loc=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        OPS.paged_attention_prefill(**args, sliding_window=-3)
    with pytest.raises(ValueError, match="sinks must be contiguous float32 \\[4\\]"):
        OPS.paged_attention_prefill(**args, sinks=torch.zeros(8))


def test_the_kernels_check_features_without_the_wrappers():
    for op, extra in (
        (OPS.unchecked.paged_attention_decode, {}),
        (OPS.unchecked.paged_attention_prefill, {"query_start_loc": torch.tensor([0, 1, 2])}),
    ):
        args = {**decode_args(), **extra}
        if extra:  # prefill's arguments come in the order query_start_loc, seq_lens
            args["seq_lens"] = args.pop("seq_lens")
        with pytest.raises(ValueError, match="sliding_window must be >= 0"):
            op(**args, sliding_window=-1)
        with pytest.raises(ValueError, match="soft_cap must be finite"):
            op(**args, soft_cap=float("inf"))
        with pytest.raises(ValueError, match="sinks must be a contiguous float32 \\[num_heads\\]"):
            op(**args, sinks=torch.zeros(3))


def test_a_block_before_the_window_may_be_any_id():
    """Only the blocks a sequence reads must be in the cache."""
    args = decode_args()
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][:, 0] = UNUSED_BLOCK  # block size 8: contexts 10 and 20
    with pytest.raises(ValueError, match="is not a block of the cache"):
        OPS.paged_attention_decode(**args)
    OPS.paged_attention_decode(**args, sliding_window=2)


def test_attention_rejects_head_sizes_over_the_limit():
    cache = torch.zeros(2, 1, 4, 520)
    query = torch.zeros(1, 1, 520)
    with pytest.raises(ValueError, match="head_size 520 is over the native CPU kernels' limit"):
        OPS.paged_attention_decode(
            query.clone(),
            query,
            cache,
            cache.clone(),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.tensor([3]),
            1.0,
        )


def test_prefill_rejects_bad_query_layouts():
    args = decode_args()
    args.pop("seq_lens")
    lens = torch.tensor([10, 20])
    with pytest.raises(ValueError, match="query_start_loc must be contiguous int64 \\[3\\]"):
        OPS.paged_attention_prefill(**args, query_start_loc=torch.tensor([0, 2]), seq_lens=lens)
    with pytest.raises(ValueError, match="run from 0 to num_tokens"):
        OPS.paged_attention_prefill(**args, query_start_loc=torch.tensor([0, 1, 3]), seq_lens=lens)
    with pytest.raises(ValueError, match="query_start_loc must not decrease"):
        OPS.paged_attention_prefill(**args, query_start_loc=torch.tensor([0, 3, 2]), seq_lens=lens)
    with pytest.raises(ValueError, match="1 query tokens but seq_lens\\[1\\] = 0"):
        OPS.paged_attention_prefill(
            **args, query_start_loc=torch.tensor([0, 1, 2]), seq_lens=torch.tensor([10, 0])
        )


def test_reshape_and_cache_rejects_bad_arguments():
    cache = torch.zeros(4, 3, 2, 8)  # 4 blocks, 3 KV heads, 2 slots a block
    key = torch.randn(5, 3, 8)
    slots = torch.arange(5)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int64 \\[5\\]"):
        OPS.reshape_and_cache(key, key, cache, cache.clone(), slots[:4])
    with pytest.raises(ValueError, match="key must be \\[num_tokens, 3, 8\\]"):
        OPS.reshape_and_cache(key[:, :2], key[:, :2], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="key must have the caches' dtype"):
        OPS.reshape_and_cache(key.bfloat16(), key.bfloat16(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="value must be"):
        OPS.reshape_and_cache(key, key[:4], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping\\[4\\] = 8 is past the cache's 8 slots"):
        OPS.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2, 3, 8]))


def test_copy_and_swap_reject_bad_arguments():
    cache = torch.zeros(4, 2, 1, 8)
    pairs = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="key_caches\\[1\\] must be a contiguous CPU tensor"):
        OPS.copy_blocks([cache, torch.zeros(5, 2, 1, 8)], [cache.clone(), cache.clone()], pairs)
    with pytest.raises(ValueError, match="2 layers but value_caches 1"):
        OPS.copy_blocks([cache, cache], [cache], pairs)
    with pytest.raises(ValueError, match="block_mapping must be contiguous int64 \\[n, 2\\]"):
        OPS.copy_blocks([cache], [cache.clone()], pairs.int())
    with pytest.raises(ValueError, match="block_mapping\\[0, 1\\] = 4 is not a block"):
        OPS.copy_blocks([cache], [cache.clone()], torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="dst must have src's block shape"):
        OPS.swap_blocks(cache, torch.zeros(4, 2, 1, 16), pairs)
    with pytest.raises(ValueError, match="is not a block of dst \\(2 blocks\\)"):
        OPS.swap_blocks(cache, torch.zeros(2, 2, 1, 8), torch.tensor([[3, 2]]))
    with pytest.raises(ValueError, match="src must be on the CPU"):
        OPS.swap_blocks(cache.to("meta"), cache, pairs)


# -- the loader -----------------------------------------------------------------------


def test_available_reports_where_the_ops_came_from():
    ok, reason = NativeCpuOps.available()
    assert ok and "loaded from" in reason
    assert isinstance(NativeCpuOps.load(), NativeCpuOps)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    result = load_cpu_ops.__wrapped__()
    assert result.module is None and "PAGEDSERVE_NATIVE=0" in result.reason


def test_a_built_library_loads_without_building_again(monkeypatch):
    def no_build(*_):
        raise AssertionError("rebuilt an unchanged library")

    monkeypatch.setattr(build, "_build", no_build)
    assert load_cpu_ops.__wrapped__().ok


def write_sources(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny.cpp").write_text(textwrap.dedent(body))
    return directory


def test_a_failed_build_returns_the_compiler_error(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(
        build, "CPU_SOURCES", write_sources(tmp_path / "src", "int f() { return }\n")
    )
    result = load_cpu_ops.__wrapped__()
    assert result.module is None
    assert "error" in result.reason and "tiny.cpp" in result.reason
    assert "native CPU kernels unavailable" in caplog.text


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    result = load_cpu_ops.__wrapped__()
    assert result.module is None and "no C++ compiler: `no-such-compiler`" in result.reason


def test_a_broken_cached_library_says_how_to_rebuild(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    name = f"pagedserve_cpu_{build.build_key()}"
    build_dir = tmp_path / "torch_extensions" / name
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"not a library")
    (build_dir / "built").touch()
    result = load_cpu_ops.__wrapped__()
    assert result.module is None and f"delete {build_dir} to rebuild" in result.reason


def test_changed_sources_change_the_build_directory(monkeypatch, tmp_path):
    first = build.build_key()
    monkeypatch.setattr(build, "CPU_SOURCES", write_sources(tmp_path, "int f() { return 1; }\n"))
    assert build.build_key() != first


def test_concurrent_builds_share_one_cache(tmp_path):
    """Two processes building the same (tiny) sources at once both load the result."""
    sources = write_sources(
        tmp_path / "src",
        """
        #include <pybind11/pybind11.h>
        PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
        """,
    )
    script = (
        "import sys; from pathlib import Path; from cuda_ext import build; "
        f"build.CPU_SOURCES = Path({str(sources)!r}); r = build.load_cpu_ops(); "
        "print(r.module.answer() if r.ok else r.reason)"
    )
    env = {**os.environ, build.CACHE_ENV: str(tmp_path / "cache"), "MAX_JOBS": "1"}
    repo = Path(__file__).resolve().parents[2]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script], cwd=repo, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=240)[0].strip() for run in runs]
    assert outputs == ["42", "42"]
    assert len(list((tmp_path / "cache" / "torch_extensions").iterdir())) == 1
