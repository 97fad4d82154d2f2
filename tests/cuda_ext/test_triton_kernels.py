"""The Triton kernels (cuda_ext/triton_kernels) against cuda_ext.reference: under Triton's
interpreter on a machine without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), the
same kernels compiled on a CUDA device where there is one. Ragged batches of decodes and
prefill chunks, partial last blocks, shared prefix blocks, GQA ratios, block sizes
8/12/16/32, head sizes 16..128, float32/bfloat16/float16, sliding window, soft cap,
sinks; cache writes with padding slots and projection views; block copies."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import reference
from tests.cuda_ext.attention_cases import (
    NO_FEATURES,
    Features,
    random_query,
    shuffled_block_tables,
)

triton_kernels = pytest.importorskip(
    "cuda_ext.triton_kernels", reason="triton is not installed (bash .ci/setup installs it)"
)
from cuda_ext.triton_kernels.kernel import interpreting  # noqa: E402

pytestmark = pytest.mark.timeout(120)

if interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:  # conftest sets TRITON_INTERPRET=1 here; a process that imported triton before it
    pytest.skip(
        "Triton was imported without TRITON_INTERPRET=1 and there is no GPU",
        allow_module_level=True,
    )

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# (query_len, seq_len) per sequence: decodes first, then prefill chunks (a chunk's
# context may hold earlier tokens); lengths straddle block boundaries
MIXED = [(1, 1), (1, 9), (1, 40), (5, 5), (7, 30), (16, 16), (3, 70)]


def attention_case(dtype, block_size, num_heads, num_kv_heads, head_size, rows, seed=0):
    rng = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = [q for q, _ in rows], [s for _, s in rows]
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, rng, torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=rng).to(dtype)
    value_cache = torch.randn(shape, generator=rng).to(dtype)
    query = random_query(sum(query_lens), num_heads, head_size, dtype, rng)
    return query, key_cache, value_cache, tables, query_lens, seq_lens, rng


def run_both(dtype, block_size, heads, head_size, rows, features: Features = NO_FEATURES):
    num_heads, num_kv_heads = heads
    query, kc, vc, tables, query_lens, seq_lens, rng = attention_case(
        dtype, block_size, num_heads, num_kv_heads, head_size, rows
    )
    extra = features.arguments(num_heads, rng)
    scale = head_size**-0.5
    want = reference.paged_attention_reference(
        query, kc, vc, tables.clamp(max=kc.shape[0] - 1), query_lens, seq_lens, scale, **extra
    )
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int64)
    dev = [t.to(DEVICE) for t in (query, kc, vc, tables, starts, torch.tensor(seq_lens))]
    if extra["sinks"] is not None:
        extra["sinks"] = extra["sinks"].to(DEVICE)
    out = torch.full_like(dev[0], float("nan"))
    got = triton_kernels.paged_attention(out, *dev, max(query_lens), scale, **extra)
    assert got is out
    return got.cpu(), want


def assert_close(got, want, dtype):
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_attention_over_a_ragged_batch_matches_the_reference(dtype, block_size, heads):
    got, want = run_both(dtype, block_size, heads, 32, MIXED)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("head_size", [16, 64, 80, 128])
@pytest.mark.parametrize("block_size", [12, 16])  # 12: a block size no power of two
def test_attention_takes_any_head_and_block_size(head_size, block_size):
    got, want = run_both(torch.float32, block_size, (4, 2), head_size, MIXED[:5])
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize(
    "features",
    [
        Features(sliding_window=7),
        Features(sliding_window=33),
        Features(soft_cap=5.0),
        Features(sinks=True),
        Features(sliding_window=9, soft_cap=30.0, sinks=True),
    ],
    ids=["window-7", "window-33", "soft-cap", "sinks", "all"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_features_match_the_reference(features, dtype):
    got, want = run_both(dtype, 8, (8, 2), 32, MIXED, features)
    assert_close(got, want, dtype)


def test_a_decode_only_batch_and_an_empty_one():
    got, want = run_both(torch.float32, 16, (8, 2), 64, [(1, 1), (1, 17), (1, 100)])
    assert_close(got, want, torch.float32)
    empty = torch.empty(0, 4, 16, device=DEVICE)
    caches = torch.zeros(2, 8, 4, 16, device=DEVICE)
    out = triton_kernels.paged_attention(
        empty.clone(),
        empty,
        caches,
        caches,
        torch.zeros(0, 1, dtype=torch.int64, device=DEVICE),
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        torch.zeros(0, dtype=torch.int64, device=DEVICE),
        0,
        0.25,
    )
    assert out.shape == (0, 4, 16)


def test_attention_takes_a_query_view_of_a_fused_projection():
    query, kc, vc, tables, query_lens, seq_lens, _ = attention_case(
        torch.float32, 16, 4, 2, 32, MIXED
    )
    fused = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 2 * 32)], dim=1)
    view = fused[:, : 4 * 32].view(-1, 4, 32)  # rows strided by the fused width
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    args = [t.to(DEVICE) for t in (kc, vc, tables, starts, torch.tensor(seq_lens))]
    out = torch.empty(query.shape, device=DEVICE)
    got = triton_kernels.paged_attention(out, view.to(DEVICE), *args, 16, 32**-0.5)
    want = reference.paged_attention_reference(
        query, kc, vc, tables.clamp(max=kc.shape[0] - 1), query_lens, seq_lens, 32**-0.5
    )
    assert_close(got.cpu(), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_the_reference_slots(dtype):
    rng = torch.Generator().manual_seed(3)
    key, value = (torch.randn(9, 2, 16, generator=rng).to(dtype) for _ in range(2))
    slots = torch.tensor([5, 0, -1, 17, 31, 8, -1, 12, 2])  # -1: padding, skipped
    caches = [torch.randn(4, 8, 2, 16, generator=rng).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *want, slots)
    got = [c.to(DEVICE) for c in caches]
    triton_kernels.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


def test_reshape_and_cache_takes_views_of_a_fused_projection():
    qkv = torch.randn(6, (4 + 2 + 2) * 16)
    _, key, value = qkv.split([64, 32, 32], dim=1)
    key, value = key.view(6, 2, 16), value.view(6, 2, 16)
    slots = torch.tensor([3, 4, 5, 6, 7, 8])
    want = [torch.zeros(2, 8, 2, 16) for _ in range(2)]
    reference.reshape_and_cache(key, value, *want, slots)
    got = [torch.zeros(2, 8, 2, 16, device=DEVICE) for _ in range(2)]
    triton_kernels.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE))
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


def test_reshape_and_cache_names_a_bad_argument():
    key = torch.zeros(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping has 2 slots for 3 tokens"):
        triton_kernels.reshape_and_cache(key, key, cache, cache, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_the_reference(dtype):
    cache = torch.randn(10, 16, 2, 40).to(dtype)  # a block of 1,280 elements: two chunks
    src, dst = torch.tensor([1, 4, 4]), torch.tensor([7, 0, 9])
    want = cache.clone()
    reference.copy_blocks(want, src, dst)
    got = cache.to(DEVICE)
    triton_kernels.copy_blocks(got, src.to(DEVICE), dst.to(DEVICE))
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_and_cuda_kernels_agree(dtype):
    """On the same inputs the Triton kernel, the CUDA C++ kernels and the reference
    agree (decodes through the decode kernel, chunks through the prefill one)."""
    from engine.worker.attention.metadata import AttentionMetadata
    from engine.worker.attention.native import NativeCudaBackend
    from engine.worker.attention.selector import select_backend
    from engine.worker.attention.spec import AttentionSpec
    from engine.worker.attention.triton_backend import TritonBackend

    native = select_backend("native", "cuda", dtype, block_size=16).backend
    assert isinstance(native, NativeCudaBackend)
    query, kc, vc, tables, query_lens, seq_lens, _ = attention_case(dtype, 16, 8, 2, 64, MIXED)
    tables = tables.clamp(max=kc.shape[0] - 1)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    metadata = AttentionMetadata(
        starts.cuda(),
        torch.tensor(seq_lens).cuda(),
        tables.cuda(),
        torch.zeros(len(query), dtype=torch.int64).cuda(),
        tuple(query_lens),
        tuple(seq_lens),
        num_decodes=sum(q == 1 for q in query_lens),
        block_size=16,
    )
    spec = AttentionSpec(scale=64**-0.5)
    args = (query.cuda(), kc.cuda(), vc.cuda(), metadata, spec)
    ours, theirs = TritonBackend().attend(*args).cpu(), native.attend(*args).cpu()
    want = reference.paged_attention_reference(
        query, kc, vc, tables, query_lens, seq_lens, 64**-0.5
    )
    assert_close(ours, want, dtype)
    assert_close(theirs, want, dtype)
    assert_close(ours, theirs, dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="compares with the CPU kernels, on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "features", [NO_FEATURES, Features(sliding_window=9, soft_cap=30.0, sinks=True)]
)
def test_triton_and_native_cpu_kernels_agree(dtype, features):
    """The same inputs through the Triton kernel (interpreted) and the C++ CPU kernels
    (their head-major cache): they agree with each other and with the reference."""
    from engine.worker.attention.metadata import AttentionMetadata
    from engine.worker.attention.spec import AttentionSpec
    from engine.worker.attention.triton_backend import TritonBackend
    from tests.engine.native_backend import native_backend

    native = native_backend()
    query, kc, vc, tables, query_lens, seq_lens, rng = attention_case(dtype, 16, 8, 2, 64, MIXED)
    extra = features.arguments(8, rng)
    tables = tables.clamp(max=kc.shape[0] - 1)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    metadata = AttentionMetadata(
        starts,
        torch.tensor(seq_lens),
        tables,
        torch.zeros(len(query), dtype=torch.int64),
        tuple(query_lens),
        tuple(seq_lens),
        num_decodes=sum(q == 1 for q in query_lens),
        block_size=16,
    )
    spec = AttentionSpec(
        scale=64**-0.5,
        sliding_window=extra["sliding_window"] or None,
        logit_soft_cap=extra["soft_cap"] or None,
        has_sinks=extra["sinks"] is not None,
    )
    sinks = extra["sinks"]
    ours = TritonBackend().attend(query, kc, vc, metadata, spec, sinks)
    head_major = (reference.head_major(kc), reference.head_major(vc))
    theirs = native.attend(query, *head_major, metadata, spec, sinks)
    want = reference.paged_attention_reference(
        query, kc, vc, tables, query_lens, seq_lens, 64**-0.5, **extra
    )
    assert_close(ours, want, dtype)
    assert_close(theirs, want, dtype)
    assert_close(ours, theirs, dtype)
