"""Every attention backend equals the reference on random mixed paged batches."""

from __future__ import annotations

import random

import pytest
import torch

from cuda_ext.kv_quant import KVRowCode
from engine.worker.attention import AttentionMetadata, ReferenceBackend, SdpaBackend
from engine.worker.attention.native import NativeCpuBackend, NativeCudaBackend
from engine.worker.attention.selector import select_backend
from engine.worker.attention.spec import AttentionSpec
from tests.engine.native_backend import native_backend


def random_batch(rng: random.Random, block_size: int, num_kv_heads: int, group: int):
    """Decodes first (more than one bucket of them), then prefill chunks with context."""
    num_decodes, num_prefills = rng.randint(0, 70), rng.randint(0, 4)
    query_lens = [1] * num_decodes + [rng.randint(2, 40) for _ in range(num_prefills)]
    if not query_lens:
        query_lens = [3]
    seq_lens = [q + rng.randint(0, 60) for q in query_lens]
    tables, next_block = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    perm = list(range(next_block))
    rng.shuffle(perm)  # blocks scattered in memory
    tables = [[perm[b] for b in t] for t in tables]
    slots = []
    for t, q, s in zip(tables, query_lens, seq_lens, strict=True):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        num_decodes=sum(1 for q in query_lens if q == 1),
    )
    return metadata, next_block


def run_backend(
    backend, metadata, num_blocks, block_size, kvh, group, head, seed, spec=None, sinks=None
):
    """Fills each context's older tokens, then runs one forward with the new tokens."""
    return run_backend_with_inputs(
        backend, metadata, num_blocks, block_size, kvh, group, head, seed, spec, sinks
    )[0]


def run_backend_with_inputs(
    backend, metadata, num_blocks, block_size, kvh, group, head, seed, spec=None, sinks=None
):
    """`run_backend`, also returning the query and each sequence's K and V rows."""
    gen = torch.Generator().manual_seed(seed)
    spec = spec or AttentionSpec(scale=head**-0.5)
    shape = backend.kv_cache_shape(num_blocks, block_size, kvh, head)
    cache = (torch.zeros(shape), torch.zeros(shape))
    # Write the whole context (old tokens too) through the backend's own write path.
    all_slots, starts = [], []
    for i, s in enumerate(metadata.seq_lens_cpu):
        t = metadata.block_tables[i].tolist()
        starts.append(len(all_slots))
        all_slots += [t[p // block_size] * block_size + p % block_size for p in range(s)]
    k_all = torch.randn(len(all_slots), kvh, head, generator=gen)
    v_all = torch.randn(len(all_slots), kvh, head, generator=gen)
    backend.write(k_all, v_all, cache[0], cache[1], torch.tensor(all_slots))
    query = torch.randn(metadata.num_tokens, kvh * group, head, generator=gen)
    out = backend.attend(query, cache[0], cache[1], metadata, spec, sinks)
    return out, query, k_all, v_all, starts


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("kvh", "group"), [(4, 1), (2, 4), (1, 8)])
def test_sdpa_matches_reference(block_size, kvh, group):
    rng = random.Random(block_size * 100 + kvh * 10 + group)
    for trial in range(3):
        metadata, num_blocks = random_batch(rng, block_size, kvh, group)
        args = (metadata, num_blocks, block_size, kvh, group, 16, trial)
        expected = run_backend(ReferenceBackend(), *args)
        got = run_backend(SdpaBackend(), *args)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_sdpa_workspace_is_reused_across_calls():
    rng = random.Random(5)
    backend = SdpaBackend()
    metadata, num_blocks = random_batch(rng, 16, 2, 2)
    run_backend(backend, metadata, num_blocks, 16, 2, 2, 8, 0)
    buffers = {name: buf.data_ptr() for name, buf in backend.workspace._buffers.items()}
    run_backend(backend, metadata, num_blocks, 16, 2, 2, 8, 1)
    assert {n: b.data_ptr() for n, b in backend.workspace._buffers.items()} == buffers


def assert_copies_whole_blocks(backend) -> None:
    """copy_blocks moves whole blocks along the backend's block dimension, nothing else."""
    shape = backend.kv_cache_shape(6, 4, 2, 8)
    gen = torch.Generator().manual_seed(0)
    kv_cache = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))]
    before = [(k.clone(), v.clone()) for k, v in kv_cache]
    src, dst = torch.tensor([1, 4]), torch.tensor([3, 0])
    backend.copy_blocks(kv_cache, src, dst)
    dim = backend.block_dim
    for (k, v), (k0, v0) in zip(kv_cache, before, strict=True):
        for new, old in ((k, k0), (v, v0)):
            for s, d in ((1, 3), (4, 0)):
                assert torch.equal(new.select(dim, d), old.select(dim, s))
            for untouched in (1, 2, 4, 5):
                assert torch.equal(new.select(dim, untouched), old.select(dim, untouched))


@pytest.mark.parametrize("backend", [ReferenceBackend(), SdpaBackend()])
def test_copy_blocks_copies_whole_blocks_in_each_backends_layout(backend):
    assert_copies_whole_blocks(backend)


def test_native_cpu_backend_keeps_its_cache_head_major():
    backend = native_backend()
    assert backend.kv_cache_shape(6, 4, 2, 8) == (6, 2, 4, 8)  # blocks, KV heads, slots, head
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)  # [tokens, kv_heads, head]
    caches = [torch.zeros(6, 2, 4, 8) for _ in "kv"]
    backend.write(key, value, *caches, torch.tensor([5, 0, 23]))  # block 1 slot 1, ...
    for cache, rows in zip(caches, (key, value), strict=True):
        assert torch.equal(cache[1, :, 1], rows[0]) and torch.equal(cache[0, :, 0], rows[1])
        assert torch.equal(cache[5, :, 3], rows[2])
        assert cache.count_nonzero() == rows.count_nonzero()


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("kvh", "group"), [(4, 1), (2, 4), (1, 8)])
def test_native_cpu_backend_matches_reference(block_size, kvh, group):
    backend = native_backend()
    rng = random.Random(block_size * 1000 + kvh * 10 + group)
    for trial in range(2):
        metadata, num_blocks = random_batch(rng, block_size, kvh, group)
        args = (metadata, num_blocks, block_size, kvh, group, 16, trial)
        expected = run_backend(ReferenceBackend(), *args)
        torch.testing.assert_close(run_backend(backend, *args), expected, atol=2e-5, rtol=1e-4)


def test_native_cpu_backend_copies_whole_blocks():
    assert_copies_whole_blocks(native_backend())


SPECS = {
    "window1": dict(sliding_window=1),
    "window5": dict(sliding_window=5),
    "window17": dict(sliding_window=17),
    "soft-cap": dict(logit_soft_cap=0.5),
    "sinks": dict(has_sinks=True),
    "all": dict(sliding_window=9, logit_soft_cap=2.0, has_sinks=True),
}


def dense_attention(query, k_all, v_all, starts, metadata, spec, sinks):
    """Each query token against its sequence's contiguous K/V rows, masks written out."""
    out = torch.empty_like(query)
    heads, kvh = query.shape[1], k_all.shape[1]
    for i, (q_len, s_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    ):
        q0 = int(metadata.query_start_loc[i])
        k = k_all[starts[i] : starts[i] + s_len].repeat_interleave(heads // kvh, dim=1)
        v = v_all[starts[i] : starts[i] + s_len].repeat_interleave(heads // kvh, dim=1)
        for t in range(q_len):
            pos = s_len - q_len + t
            visible = [j for j in range(s_len) if j <= pos and j >= spec.first_visible(pos)]
            scores = torch.einsum("hd,khd->hk", query[q0 + t], k[visible]) * spec.scale
            if spec.logit_soft_cap:
                scores = spec.logit_soft_cap * torch.tanh(scores / spec.logit_soft_cap)
            weights = scores.exp()
            denominator = weights.sum(-1, keepdim=True)
            if sinks is not None:
                denominator = denominator + sinks.exp().unsqueeze(1)
            out[q0 + t] = torch.einsum("hk,khd->hd", weights / denominator, v[visible])
    return out


def spec_case(name, head, heads):
    spec = AttentionSpec(scale=head**-0.5, **SPECS[name])
    sinks = (
        torch.randn(heads, generator=torch.Generator().manual_seed(3)) if spec.has_sinks else None
    )
    return spec, sinks


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_window_cap_and_sinks_match_dense_attention(name, block_size):
    rng = random.Random(block_size)
    kvh, group, head = 2, 2, 8
    spec, sinks = spec_case(name, head, kvh * group)
    metadata, num_blocks = random_batch(rng, block_size, kvh, group)
    args = (metadata, num_blocks, block_size, kvh, group, head, 0, spec, sinks)
    got, query, k_all, v_all, starts = run_backend_with_inputs(ReferenceBackend(), *args)
    expected = dense_attention(query, k_all, v_all, starts, metadata, spec, sinks)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "native"])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_window_cap_and_sinks_match_reference(name, block_size, backend):
    rng = random.Random(block_size + 50)
    kvh, group, head = 2, 2, 8
    spec, sinks = spec_case(name, head, kvh * group)
    attention = SdpaBackend() if backend == "sdpa" else native_backend()
    for trial in range(2):
        metadata, num_blocks = random_batch(rng, block_size, kvh, group)
        args = (metadata, num_blocks, block_size, kvh, group, head, trial, spec, sinks)
        expected = run_backend(ReferenceBackend(), *args)
        torch.testing.assert_close(run_backend(attention, *args), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_no_block_before_the_window_is_read(backend):
    """Blocks wholly before every query's window may be anything (the hybrid allocator
    frees them): NaN there changes nothing."""
    rng = random.Random(11)
    block_size, kvh, group, head = 4, 2, 2, 8
    spec = AttentionSpec(scale=head**-0.5, sliding_window=6)
    metadata, num_blocks = random_batch(rng, block_size, kvh, group)
    args = (metadata, num_blocks + 1, block_size, kvh, group, head, 0, spec)
    make = ReferenceBackend if backend == "reference" else native_backend
    expected = run_backend(make(), *args)
    tables = metadata.block_tables.clone()
    for i, (q_len, s_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    ):
        unread = spec.first_visible(s_len - q_len) // block_size
        tables[i, :unread] = num_blocks  # the poisoned block
    poisoned = make()
    poisoned.write = _poisoning_write(poisoned.write, num_blocks, block_size)
    got = run_backend(poisoned, _with_tables(metadata, tables), *args[1:])
    assert torch.equal(got, expected)


def _poisoning_write(write, block, block_size):
    def poisoned(key, value, key_cache, value_cache, slot_mapping):
        write(key, value, key_cache, value_cache, slot_mapping)
        key_cache[block].fill_(float("nan"))
        value_cache[block].fill_(float("nan"))

    return poisoned


def _with_tables(metadata, tables):
    from dataclasses import replace

    return replace(metadata, block_tables=tables)


def test_a_backend_refuses_a_spec_feature_it_cannot_do():
    class NoWindows(ReferenceBackend):
        name = "no-windows"
        unsupported_features = frozenset({"sliding window"})

    NoWindows().check_spec(AttentionSpec(scale=1.0, logit_soft_cap=3.0))
    with pytest.raises(ValueError, match="'no-windows' attention backend cannot do sliding window"):
        NoWindows().check_spec(AttentionSpec(scale=1.0, sliding_window=4))


def test_both_native_backends_do_every_feature():
    every = AttentionSpec(scale=1.0, sliding_window=4, logit_soft_cap=3.0, has_sinks=True)
    NativeCpuBackend(ops=None).check_spec(every)
    NativeCudaBackend(ops=None).check_spec(every)


def test_a_block_size_the_cuda_kernels_lack_picks_sdpa_or_is_refused_by_name():
    """Checked before the kernels load, so it holds on any machine."""
    choice = select_backend("auto", device="cuda", block_size=64)
    assert isinstance(choice.backend, SdpaBackend)
    assert "blocks of 8, 16, 32 tokens, not block_size=64" in choice.reason
    with pytest.raises(ValueError, match="not block_size=64"):
        select_backend("native", device="cuda", block_size=64)


def test_the_triton_backend_is_chosen_by_name_or_refused_with_the_reason(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed (bash .ci/setup installs it)")
    from cuda_ext.triton_kernels import kernel

    monkeypatch.setattr(kernel, "interpreting", lambda: True)
    choice = select_backend("triton", device="cpu")
    assert choice.backend.name == "triton" and "TRITON_INTERPRET=1" in choice.reason
    with pytest.raises(ValueError, match="Triton kernels read float caches, not 'int8'"):
        select_backend("triton", device="cpu", kv_code=KVRowCode.INT8)
    assert select_backend("auto", device="cpu").backend.name != "triton"  # CUDA only
    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="run on CUDA, not 'cpu' .*TRITON_INTERPRET=1"):
        select_backend("triton", device="cpu")


def test_auto_on_cuda_takes_the_faster_kernels_or_the_native_ones_if_triton_fails(monkeypatch):
    from engine.worker.attention import selector
    from engine.worker.attention.backend_race import AttentionShape

    native = selector.BackendChoice(NativeCudaBackend(ops=None), "native CUDA kernels loaded")
    triton = selector.BackendChoice(ReferenceBackend(), "Triton kernels, compiled for CUDA")
    shape = AttentionShape(8, 2, 64)
    for native_ms, winner in ((2.0, triton.backend), (0.5, native.backend)):
        times = {id(native.backend): native_ms, id(triton.backend): 1.0}
        monkeypatch.setattr(selector, "decode_ms", lambda b, *_, t=times: t[id(b)])
        chosen = selector._faster_on_cuda(native, triton, shape, 16, torch.bfloat16)
        assert chosen.backend is winner and "ms native" in chosen.reason

    def broken(backend, *_):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(selector, "decode_ms", broken)
    chosen = selector._faster_on_cuda(native, triton, shape, 16, torch.bfloat16)
    assert chosen.backend is native.backend and "race failed: no compiler" in chosen.reason
    lacking = selector.BackendChoice(None, "blocks of 8, 16, 32 tokens, not block_size=64")
    chosen = selector._faster_on_cuda(lacking, triton, shape, 64, torch.bfloat16)
    assert chosen.backend is triton.backend and "not block_size=64" in chosen.reason
