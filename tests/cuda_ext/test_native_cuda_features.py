"""The CUDA attention kernels' optional features against cuda_ext.reference, on a GPU.

Sliding windows, logit soft caps and attention sinks, alone and together, in decode (v1,
v2 and the automatic choice) and in prefill. Besides the NaN slots of every paged case
(cuda_cases.py), the table entries of blocks wholly before each sequence's first window
point at a block of NaN, as the hybrid allocator's freed entries may: a kernel that reads
one fails. Every case draws fresh random inputs.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from cuda_ext import native_cuda
from tests.cuda_ext.cuda_cases import (
    DEVICE,
    DTYPES,
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

FEATURES = {
    "window1": dict(sliding_window=1),
    "window7": dict(sliding_window=7),
    "window40": dict(sliding_window=40),
    "window600": dict(sliding_window=600),  # wider than a v2 partition
    "soft-cap": dict(soft_cap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=40, soft_cap=30.0, sinks=True),
}
HEADS = [(8, 8), (8, 2), (8, 1), (12, 2)]  # MHA, GQA 4:1, MQA, a part-filled slice of 4
# (head size, block size), cycled: the grouped path (64, 128), the specialized plain
# kernel (80 in 16-bit types) and the generic one (112).
SHAPES = [(64, 8), (128, 16), (112, 32), (80, 16)]
FEATURE_CASES = [
    (name, dtype, heads, *SHAPES[i % len(SHAPES)])
    for i, (name, dtype, heads) in enumerate(itertools.product(FEATURES, DTYPES, HEADS))
]


@pytest.fixture(scope="module")
def kernels() -> native_cuda.CudaKernels:
    return loaded_kernels()


def feature_arguments(case: dict, num_heads: int) -> dict:
    """The kernels' and the reference's keywords for a case of FEATURES; sinks drawn here."""
    features = dict(case)
    if features.pop("sinks", False):
        features["sinks"] = torch.randn(num_heads, device=DEVICE) * 2
    return features


def hide_before_window(kv: PagedKV, query_lens: list[int], window: int) -> PagedKV:
    """`kv` with one more block, all NaN, and every table entry wholly before the
    sequence's first query's window pointing at it."""
    nan_block = kv.key_cache.shape[0]
    key_cache, value_cache = (
        torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (kv.key_cache, kv.value_cache)
    )
    tables = kv.block_tables.clone()
    block_size = kv.key_cache.shape[1]
    for i, (q_len, s_len) in enumerate(zip(query_lens, kv.seq_lens, strict=True)):
        unread = max(0, s_len - q_len - window + 1) // block_size if window else 0
        tables[i, :unread] = nan_block
    caches = dict(key_cache=key_cache, value_cache=value_cache)
    return dataclasses.replace(kv, **caches, block_tables=tables)


def decode(kernels, version: str, query, kv: PagedKV, scale: float, features: dict):
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=DEVICE)  # poisoned
    args = (out, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens_tensor, scale)
    if version == "v1":
        kernels.paged_attention_v1(*args, **features)
    elif version == "v2":
        kernels.paged_attention_v2(*args, max_seq_len=max(kv.seq_lens), **features)
    else:
        kernels.paged_attention(*args, **features)
    return out


def check_decode(kernels, version, seq_lens, dtype, heads, head_size, block_size, case):
    num_heads, num_kv_heads = heads
    features = feature_arguments(case, num_heads)
    window = features.get("sliding_window", 0)
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype)
    hidden = hide_before_window(kv, [1] * len(seq_lens), window)
    query = torch.randn(len(seq_lens), num_heads, head_size, device=DEVICE).to(dtype)
    scale = head_size**-0.5
    got = decode(kernels, version, query, hidden, scale, features)
    want = expected_attention(query, kv, [1] * len(seq_lens), scale, **features)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("name,dtype,heads,head_size,block_size", FEATURE_CASES)
def test_decode_with_window_cap_and_sinks_matches_reference(
    kernels, version, name, dtype, heads, head_size, block_size
):
    window = FEATURES[name].get("sliding_window", 40)
    # Ragged, around the block, the window and v2's 512-token partitions.
    seq_lens = [1, 7, block_size + 1, window, window + 1, 100, 513, 1100, 1600]
    case = FEATURES[name]
    check_decode(kernels, version, seq_lens, dtype, heads, head_size, block_size, case)


@pytest.mark.parametrize(
    "version,window,dtype", grid(["v1", "v2", "auto"], [100, 600, 4096], [torch.bfloat16])
)
def test_decode_with_a_window_over_long_contexts(kernels, version, window, dtype):
    """Most of a long context lies before the window: v2's partitions there are empty."""
    seq_lens = [32768, 1, 20000, 4097]
    case = dict(sliding_window=window, soft_cap=20.0, sinks=True)
    check_decode(kernels, version, seq_lens, dtype, (32, 8), 128, 16, case)


@pytest.mark.parametrize("name,dtype,heads,head_size,block_size", FEATURE_CASES)
def test_prefill_with_window_cap_and_sinks_matches_reference(
    kernels, name, dtype, heads, head_size, block_size
):
    num_heads, num_kv_heads = heads
    features = feature_arguments(FEATURES[name], num_heads)
    # A decode, a chunk after a prefix longer than the window, whole prompts over many
    # query tiles, a chunk ending on a block boundary.
    query_lens = [1, 17, 300, 5, block_size, 64]
    seq_lens = [41, 17 + 100, 300, 5 + 700, 2 * block_size, 64]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype)
    hidden = hide_before_window(kv, query_lens, features.get("sliding_window", 0))
    query = torch.randn(sum(query_lens), num_heads, head_size, device=DEVICE).to(dtype)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    scale = head_size**-0.5
    kernels.prefill_attention(
        out,
        query,
        hidden.key_cache,
        hidden.value_cache,
        hidden.block_tables,
        starts.to(DEVICE),
        hidden.seq_lens_tensor,
        scale,
        max_query_len=max(query_lens),
        **features,
    )
    want = expected_attention(query, kv, query_lens, scale, **features)
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])


def test_large_sink_logits_stay_finite(kernels):
    """Sinks far above and below every logit: exp(sink) alone would overflow; the kernels
    move the softmax's max to the sink."""
    kv = make_paged_kv([3000, 40], 2, 64, 16, torch.float32)
    query = torch.randn(2, 4, 64, device=DEVICE)
    sinks = torch.tensor([100.0, -100.0, 0.0, 30.0], device=DEVICE)
    want = expected_attention(query, kv, [1, 1], 0.125, sinks=sinks)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    for version in ("v1", "v2"):
        got = decode(kernels, version, query, kv, 0.125, dict(sinks=sinks))
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    prefilled = torch.empty_like(query)
    caches = (kv.key_cache, kv.value_cache, kv.block_tables)
    kernels.prefill_attention(
        prefilled, query, *caches, starts, kv.seq_lens_tensor, 0.125, 1, sinks=sinks
    )
    torch.testing.assert_close(prefilled, want, **TOLERANCE[torch.float32])
    assert prefilled[:, 0].abs().max() < 1e-30  # the sink took all the weight


@pytest.mark.parametrize(
    "argument,features",
    [
        ("sliding_window", lambda: dict(sliding_window=-1)),
        ("sliding_window", lambda: dict(sliding_window=2.5)),
        ("soft_cap", lambda: dict(soft_cap=-1.0)),
        ("soft_cap", lambda: dict(soft_cap=float("inf"))),
        ("sinks", lambda: dict(sinks=torch.zeros(3, device=DEVICE))),  # not one per head
        ("sinks", lambda: dict(sinks=torch.zeros(4, device=DEVICE, dtype=torch.float16))),
        ("sinks", lambda: dict(sinks=torch.zeros(4))),  # on the CPU
    ],
)
def test_bad_features_are_refused_by_name(kernels, argument, features):
    kv = make_paged_kv([20, 3], 2, 64, 16, torch.float16)
    query = torch.randn(2, 4, 64, device=DEVICE).half()
    args = (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens_tensor, 0.125)
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        kernels.paged_attention(torch.empty_like(query), query, *args, **features())
