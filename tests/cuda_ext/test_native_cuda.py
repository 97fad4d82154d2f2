"""The CUDA kernels against cuda_ext.reference, on a GPU (every test skips without one).

Caches are random, each sequence's blocks scattered through a shuffled block table, and
every slot no context owns (block tails past a context, spare blocks, block-table padding)
holds NaN: a kernel that reads past a context, or multiplies a masked slot by zero, fails.
Run on a GPU machine with `pytest -m gpu tests/cuda_ext/test_native_cuda.py` (the first test
builds the extension, about a minute or two).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cuda_ext import native_cuda, reference
from tests.cuda_ext.cuda_cases import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    HEAD_SIZES,
    HEADS,
    TOLERANCE,
    PagedKV,
    expected_attention,
    grid,
    loaded_kernels,
    make_paged_kv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def kernels() -> native_cuda.CudaKernels:
    return loaded_kernels()


# --- reshape_and_cache ---------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,head_size,block_size,num_kv_heads", grid(DTYPES, HEAD_SIZES, BLOCK_SIZES, [1, 2, 8])
)
def test_reshape_and_cache_writes_the_reference_slots(
    kernels, dtype, head_size, block_size, num_kv_heads
):
    num_blocks, num_tokens = 7, 20
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, device=DEVICE)
    key_cache = key_cache.to(dtype)
    value_cache = torch.randn_like(key_cache)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # padding tokens write nothing
    key = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE).to(dtype)
    value = torch.randn_like(key)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


def test_reshape_and_cache_takes_key_and_value_views_of_a_fused_projection(kernels):
    num_tokens, heads, kv_heads, head_size, block_size = 9, 4, 2, 64, 16
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size, device=DEVICE).half()
    _, key, value = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    key = key.view(num_tokens, kv_heads, head_size)  # strided rows
    value = value.view(num_tokens, kv_heads, head_size)
    key_cache = torch.zeros(3, block_size, kv_heads, head_size, device=DEVICE).half()
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(5, 5 + num_tokens, device=DEVICE)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat_k = key_cache.view(-1, kv_heads, head_size)
    flat_v = value_cache.view(-1, kv_heads, head_size)
    assert torch.equal(flat_k[5 : 5 + num_tokens], key)
    assert torch.equal(flat_v[5 : 5 + num_tokens], value)
    assert flat_k[:5].count_nonzero() == 0 and flat_k[5 + num_tokens :].count_nonzero() == 0


# --- paged attention (decode) --------------------------------------------------------


def run_decode(kernels, version: str, query, kv: PagedKV, scale: float) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=DEVICE)  # poisoned
    args = (out, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens_tensor, scale)
    if version == "v1":
        kernels.paged_attention_v1(*args)
    elif version == "v2":
        kernels.paged_attention_v2(*args, max_seq_len=max(kv.seq_lens))
    else:
        kernels.paged_attention(*args)
    return out


@pytest.mark.parametrize(
    "version,dtype,head_size,block_size,heads",
    grid(["v1", "v2"], DTYPES, HEAD_SIZES, BLOCK_SIZES, HEADS),
)
def test_paged_attention_matches_reference(kernels, version, dtype, head_size, block_size, heads):
    num_heads, num_kv_heads = heads
    # Ragged: one token, a partial block, exact blocks, and v2 partition edges (512).
    seq_lens = [1, 7, block_size, block_size + 1, 100, 512, 513, 1100]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, device=DEVICE).to(dtype)
    scale = head_size**-0.5
    got = run_decode(kernels, version, query, kv, scale)
    want = expected_attention(query, kv, [1] * len(seq_lens), scale)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize(
    "version,dtype,head_size,heads",
    grid(["v1", "v2"], DTYPES, [64, 128], [(6, 3), (9, 3), (12, 2)]),
)
def test_paged_attention_takes_groups_of_any_size(kernels, version, dtype, head_size, heads):
    """The grouped kernel attends a KV head's query heads in slices of four: groups of 2, 3
    and 6 leave a slice part-filled, whose idle heads must write nothing."""
    num_heads, num_kv_heads = heads
    seq_lens = [1, 17, 600]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, 16, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, device=DEVICE).to(dtype)
    got = run_decode(kernels, version, query, kv, head_size**-0.5)
    want = expected_attention(query, kv, [1] * len(seq_lens), head_size**-0.5)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize(
    "version,dtype,heads", grid(["v1", "v2", "auto"], [torch.float16, torch.bfloat16], HEADS)
)
def test_paged_attention_over_long_contexts(kernels, version, dtype, heads):
    num_heads, num_kv_heads = heads
    seq_lens = [32768, 1, 20000, 4097]
    kv = make_paged_kv(seq_lens, num_kv_heads, 128, 16, dtype)
    query = torch.randn(len(seq_lens), num_heads, 128, device=DEVICE).to(dtype)
    got = run_decode(kernels, version, query, kv, 128**-0.5)
    want = expected_attention(query, kv, [1] * len(seq_lens), 128**-0.5)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_paged_attention_takes_a_query_view_of_a_fused_projection(kernels, version):
    heads, kv_heads, head_size = 8, 2, 128
    seq_lens = [5, 700, 33]
    kv = make_paged_kv(seq_lens, kv_heads, head_size, 16, torch.float16)
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * head_size, device=DEVICE).half()
    query = qkv[:, : heads * head_size].view(len(seq_lens), heads, head_size)
    assert not query.is_contiguous()
    got = run_decode(kernels, version, query, kv, 0.1)
    want = expected_attention(query.contiguous(), kv, [1] * len(seq_lens), 0.1)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float16])


def test_paged_attention_with_no_sequences_does_nothing(kernels):
    kv = make_paged_kv([3], 2, 64, 16, torch.float16)
    query = torch.empty(0, 2, 64, device=DEVICE).half()
    out = torch.empty_like(query)
    empty_tables = kv.block_tables[:0]
    no_lens = kv.seq_lens_tensor[:0]
    kernels.paged_attention_v1(out, query, kv.key_cache, kv.value_cache, empty_tables, no_lens, 1.0)
    kernels.paged_attention_v2(out, query, kv.key_cache, kv.value_cache, empty_tables, no_lens, 1.0)
    torch.cuda.synchronize()


# --- prefill attention ---------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,head_size,block_size,heads", grid(DTYPES, HEAD_SIZES, BLOCK_SIZES, HEADS)
)
def test_prefill_attention_matches_reference(kernels, dtype, head_size, block_size, heads):
    num_heads, num_kv_heads = heads
    # A decode, a chunk after earlier context, a whole prompt over many tiles, a short one.
    query_lens = [1, 17, 300, 5]
    seq_lens = [41, 17 + 16, 300, 5 + 100]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype)
    query = torch.randn(sum(query_lens), num_heads, head_size, device=DEVICE).to(dtype)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    out = torch.empty_like(query)
    scale = head_size**-0.5
    kernels.prefill_attention(
        out,
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        starts.to(DEVICE),
        kv.seq_lens_tensor,
        scale,
        max_query_len=max(query_lens),
    )
    want = expected_attention(query, kv, query_lens, scale)
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])


def test_prefill_attention_reads_max_query_len_when_not_given(kernels):
    query_lens, seq_lens = [3, 40], [10, 40]
    kv = make_paged_kv(seq_lens, 2, 64, 16, torch.bfloat16)
    query = torch.randn(sum(query_lens), 4, 64, device=DEVICE).bfloat16()
    starts = torch.tensor([0, 3, 43], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(query)
    kernels.prefill_attention(
        out, query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens_tensor, 0.125
    )
    want = expected_attention(query, kv, query_lens, 0.125)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.bfloat16])


# --- copy_blocks and swap_blocks -----------------------------------------------------


# Blocks of (1, 1, 3) are 6 or 12 bytes, not a multiple of 16: the bytewise path.
@pytest.mark.parametrize("dtype,block_shape", grid(DTYPES, [(16, 2, 64), (1, 1, 3)]))
def test_copy_blocks_copies_every_layer_in_one_call(kernels, dtype, block_shape):
    num_layers, num_blocks = 3, 10
    keys = [
        torch.randn(num_blocks, *block_shape, device=DEVICE).to(dtype) for _ in range(num_layers)
    ]
    values = [torch.randn_like(k) for k in keys]
    src, dst = torch.tensor([0, 3, 3, 7]), torch.tensor([1, 4, 9, 2])
    want_keys = [k.clone() for k in keys]
    want_values = [v.clone() for v in values]
    for cache in want_keys + want_values:
        reference.copy_blocks(cache, src.to(DEVICE), dst.to(DEVICE))
    mapping = torch.stack([src, dst], dim=1).to(DEVICE)
    kernels.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_keys + want_values, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,direction", grid(DTYPES, ["out", "in"]))
def test_swap_blocks_moves_blocks_between_gpu_and_pinned_cpu(kernels, dtype, direction):
    gpu = torch.randn(12, 16, 2, 64, device=DEVICE).to(dtype)
    cpu = torch.randn(6, 16, 2, 64).to(dtype).pin_memory()
    if direction == "out":
        src, dst, mapping = gpu, cpu, torch.tensor([[0, 5], [11, 0], [4, 2]])
    else:
        src, dst, mapping = cpu, gpu, torch.tensor([[5, 0], [0, 11], [2, 4]])
    want = dst.clone()
    reference.swap_blocks(src, want, mapping[:, 0], mapping[:, 1])
    kernels.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want.cpu())


# --- argument checks -----------------------------------------------------------------


def decode_args(**overrides) -> dict:
    kv = make_paged_kv([20, 3], 2, 64, 16, torch.float16)
    query = torch.randn(2, 4, 64, device=DEVICE).half()
    args = {
        "out": torch.empty_like(query),
        "query": query,
        "key_cache": kv.key_cache,
        "value_cache": kv.value_cache,
        "block_tables": kv.block_tables,
        "seq_lens": kv.seq_lens_tensor,
        "scale": 0.125,
    }
    return args | overrides


@pytest.mark.parametrize(
    "argument,bad",
    [
        ("query", lambda a: {"query": a["query"].cpu()}),
        ("query", lambda a: {"query": a["query"].to(torch.int8)}),
        ("out", lambda a: {"out": a["out"].float()}),
        ("out", lambda a: {"out": a["out"][:1]}),
        ("block_tables", lambda a: {"block_tables": a["block_tables"].long()}),
        ("seq_lens", lambda a: {"seq_lens": a["seq_lens"][:1]}),
        ("key_cache", lambda a: {"key_cache": a["key_cache"].transpose(1, 2)}),
        ("value_cache", lambda a: {"value_cache": a["value_cache"][:-1]}),
        (
            "key_cache",  # blocks of 12 tokens: no decode kernel is instantiated for them
            lambda a: {
                "key_cache": a["key_cache"][:, :12].contiguous(),
                "value_cache": a["value_cache"][:, :12].contiguous(),
            },
        ),
    ],
)
def test_decode_names_the_bad_argument(kernels, argument, bad):
    args = decode_args()
    args |= bad(args)
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        kernels.paged_attention_v1(**args)


def test_decode_rejects_an_unsupported_head_size(kernels):
    query = torch.randn(1, 2, 300, device=DEVICE).half()
    cache = torch.zeros(2, 16, 2, 300, device=DEVICE).half()
    args = decode_args(out=torch.empty_like(query), query=query, key_cache=cache)
    args["value_cache"] = cache.clone()
    args["block_tables"] = args["block_tables"][:1]
    args["seq_lens"] = args["seq_lens"][:1]
    with pytest.raises(ValueError, match="^head_size must be"):
        kernels.paged_attention_v1(**args)


def test_v2_rejects_a_context_longer_than_the_block_tables(kernels):
    with pytest.raises(ValueError, match="^block_tables must be wide enough"):
        kernels.paged_attention_v2(**decode_args(), max_seq_len=10_000)


def test_swap_names_the_bad_argument(kernels):
    gpu = torch.zeros(4, 16, 2, 64, device=DEVICE).half()
    pinned = torch.zeros(4, 16, 2, 64).half().pin_memory()
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="^dst must be on CUDA or in pinned"):
        kernels.swap_blocks(gpu, torch.zeros(4, 16, 2, 64).half(), mapping)
    with pytest.raises(ValueError, match="^block_mapping must be"):
        kernels.swap_blocks(gpu, pinned, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="^block_mapping must be"):
        kernels.swap_blocks(gpu, pinned, mapping.to(DEVICE))
    with pytest.raises(ValueError, match="^dst must be"):
        kernels.swap_blocks(gpu, pinned.float(), mapping)
