"""Blocks out of a paged cache and back (engine/kv_transfer/blocks.py, payload.py): a
gathered payload scattered into fresh blocks gives identical bytes, in every layout the
attention backends keep and across them; a payload that does not fit is refused."""

from __future__ import annotations

import pytest
import torch

from engine.kv_transfer.blocks import (
    TOKEN_MAJOR,
    KVLayout,
    gather_blocks,
    hidden_of,
    scatter_blocks,
    with_hidden,
)
from engine.kv_transfer.payload import BlocksHeader, KVPayload, select_blocks
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.native import NativeCpuBackend, NativeCudaBackend
from engine.worker.attention.sdpa import SdpaBackend

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 3, 10, 4, 2, 8
SHAPES = {
    "house": AttentionBackend.kv_cache_shape,
    "native-cpu": NativeCpuBackend.kv_cache_shape,
    "sdpa": SdpaBackend.kv_cache_shape,
}


def make_cache(shape_of, dtype: torch.dtype, seed: int | None = 0, width: int = HEAD_SIZE):
    """Per layer (K, V) in the backend's layout: random (`seed`) or zeroed (None)."""
    shape = shape_of(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, width)
    if seed is None:
        return [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(NUM_LAYERS)
        ]
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return [
            (
                torch.randint(0, 256, shape, generator=gen, dtype=dtype),
                torch.randint(0, 256, shape, generator=gen, dtype=dtype),
            )
            for _ in range(NUM_LAYERS)
        ]
    return [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(NUM_LAYERS)
    ]


def block(cache, layer: int, kv: int, block_id: int, layout: KVLayout) -> torch.Tensor:
    """One block in canonical order: [block_size, num_kv_heads, head_size]."""
    picked = cache[layer][kv].index_select(layout.block_dim, torch.tensor([block_id]))
    return layout.to_canonical(picked)[0]


def test_layouts_are_read_off_the_backends():
    assert KVLayout.of(SHAPES["house"]) == TOKEN_MAJOR
    assert KVLayout.of(NativeCudaBackend.kv_cache_shape) == TOKEN_MAJOR
    assert KVLayout.of(SHAPES["native-cpu"]).block_dim == 0
    assert KVLayout.of(SHAPES["sdpa"]).block_dim == 1
    with pytest.raises(ValueError, match="permute \\[num_blocks, block_size"):
        KVLayout.of(lambda nb, bs, h, d: (nb, h, d // 2, bs, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_round_trip_gives_identical_bytes(name, dtype):
    layout = KVLayout.of(SHAPES[name])
    source, target = make_cache(SHAPES[name], dtype), make_cache(SHAPES[name], dtype, seed=None)
    payload = gather_blocks(source, [7, 2, 5], layout)
    assert payload.header == BlocksHeader(
        NUM_LAYERS,
        3,
        (BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
        str(dtype).removeprefix("torch."),
        3 * NUM_LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_SIZE * dtype.itemsize,
    )
    assert payload.data.readonly
    scatter_blocks(target, [0, 9, 4], payload, layout)
    for layer in range(NUM_LAYERS):
        for kv in range(2):
            for src, dst in [(7, 0), (2, 9), (5, 4)]:
                assert torch.equal(
                    block(target, layer, kv, dst, layout), block(source, layer, kv, src, layout)
                )
            untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 9, 4)]
            assert all(block(target, layer, kv, b, layout).count_nonzero() == 0 for b in untouched)
    assert bytes(gather_blocks(target, [0, 9, 4], layout).data) == bytes(payload.data)


def test_bfloat16_bits_survive_exactly():
    source = make_cache(SHAPES["house"], torch.bfloat16)
    source[0][0][3, 0, 0, :4] = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-40])
    target = make_cache(SHAPES["house"], torch.bfloat16, seed=None)
    scatter_blocks(target, [6], gather_blocks(source, [3]))
    assert torch.equal(target[0][0][6].view(torch.int16), source[0][0][3].view(torch.int16))


@pytest.mark.parametrize(
    ("producer", "consumer"), [("house", "native-cpu"), ("native-cpu", "sdpa"), ("sdpa", "house")]
)
def test_backends_of_different_layouts_exchange_blocks(producer, consumer):
    p_layout, c_layout = KVLayout.of(SHAPES[producer]), KVLayout.of(SHAPES[consumer])
    source = make_cache(SHAPES[producer], torch.float32)
    target = make_cache(SHAPES[consumer], torch.float32, seed=None)
    scatter_blocks(target, [1, 2], gather_blocks(source, [8, 3], p_layout), c_layout)
    assert torch.equal(block(target, 2, 1, 1, c_layout), block(source, 2, 1, 8, p_layout))
    assert torch.equal(block(target, 0, 0, 2, c_layout), block(source, 0, 0, 3, p_layout))


def test_a_partial_block_list_selects_by_position():
    source = make_cache(SHAPES["house"], torch.float32)
    payload = gather_blocks(source, [1, 2, 3, 4])
    tail = select_blocks(payload, [2, 3])  # consecutive: a view of the same bytes
    assert tail.header.num_blocks == 2
    assert bytes(tail.data) == bytes(gather_blocks(source, [3, 4]).data)
    picked = select_blocks(payload, [3, 0])
    assert bytes(picked.data) == bytes(gather_blocks(source, [4, 1]).data)
    none = select_blocks(payload, [])
    assert none.header.num_bytes == 0
    target = make_cache(SHAPES["house"], torch.float32, seed=None)
    scatter_blocks(target, [], none)  # nothing to write, nothing refused
    assert all(k.count_nonzero() == 0 for k, _ in target)
    with pytest.raises(
        ValueError, match=r"block positions \[4\] are out of range: the payload has 4"
    ):
        select_blocks(payload, [4])


def test_a_payload_that_does_not_fit_is_refused_naming_each_difference():
    source = make_cache(SHAPES["house"], torch.float32)
    payload = gather_blocks(source, [1, 2])
    with pytest.raises(ValueError, match=r"blocks: payload 2, cache 3"):
        scatter_blocks(make_cache(SHAPES["house"], torch.float32, seed=None), [0, 1, 2], payload)
    with pytest.raises(ValueError, match=r"dtype: payload float32, cache bfloat16"):
        scatter_blocks(make_cache(SHAPES["house"], torch.bfloat16, seed=None), [0, 1], payload)
    wider = make_cache(SHAPES["house"], torch.float32, seed=None, width=HEAD_SIZE * 2)
    with pytest.raises(
        ValueError, match=r"block shape .*: payload \(4, 2, 8\), cache \(4, 2, 16\)"
    ):
        scatter_blocks(wider, [0, 1], payload)
    with pytest.raises(ValueError, match=r"layers: payload 3, cache 2"):
        scatter_blocks(make_cache(SHAPES["house"], torch.float32, seed=None)[:2], [0, 1], payload)


def test_bad_block_ids_and_caches_are_refused():
    cache = make_cache(SHAPES["house"], torch.float32)
    with pytest.raises(
        ValueError, match=r"block ids \[10\] are out of range: this cache has 10 blocks"
    ):
        gather_blocks(cache, [1, 10])
    payload = gather_blocks(cache, [1, 2])
    with pytest.raises(ValueError, match=r"repeat a block"):
        scatter_blocks(cache, [3, 3], payload)
    shared = [cache[0], cache[0]]
    with pytest.raises(ValueError, match="share tensors \\(a hybrid layout\\)"):
        gather_blocks(shared, [1])
    with pytest.raises(ValueError, match="the KV cache has no layers"):
        gather_blocks([], [1])


def test_a_header_or_payload_that_disagrees_with_itself_is_refused():
    with pytest.raises(
        ValueError, match=r"2 blocks of 384 bytes are 768 bytes, but num_bytes says 700"
    ):
        BlocksHeader(3, 2, (4, 2, 8), "uint8", 700)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        BlocksHeader(3, 2, (4, 2, 8), "complex64", 0)
    header = BlocksHeader(1, 1, (1, 1, 4), "float32", 32)
    with pytest.raises(ValueError, match=r"KV payload has 31 bytes of blocks; its header says 32"):
        KVPayload(header, memoryview(bytes(31)))
    with pytest.raises(ValueError, match=r"hidden_dtype must be one of"):
        BlocksHeader(1, 1, (1, 1, 4), "float32", 32, 8, "complex64")
    header = BlocksHeader(1, 1, (1, 1, 4), "float32", 32, hidden_size=8, hidden_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"15 bytes of hidden state; its header says 16"):
        KVPayload(header, memoryview(bytes(32)), memoryview(bytes(15)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_hidden_state_travels_with_the_blocks_it_follows(dtype):
    """The prompt's last hidden state rides along: kept through a selection of the
    blocks, given back bit for bit; a payload without one gives None."""
    source = make_cache(SHAPES["house"], torch.float32)
    bare = gather_blocks(source, [1, 2, 3])
    assert hidden_of(bare, "cpu") is None and bare.header.hidden_size == 0
    hidden = torch.randn(24, generator=torch.Generator().manual_seed(1)).to(dtype)
    payload = with_hidden(bare, hidden)
    assert payload.header.hidden_size == 24
    assert payload.header.hidden_dtype == str(dtype).removeprefix("torch.")
    assert payload.hidden.nbytes == 24 * dtype.itemsize and payload.hidden.readonly
    for picked in (select_blocks(payload, [1, 2]), select_blocks(payload, [2, 0])):
        got = hidden_of(picked, "cpu")
        assert got.dtype == dtype and torch.equal(got, hidden)
        assert picked.header.num_blocks == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_move_between_a_cuda_cache_and_a_cpu_cache():
    source = [(k.cuda(), v.cuda()) for k, v in make_cache(SHAPES["house"], torch.bfloat16)]
    payload = gather_blocks(source, [7, 2])
    native = KVLayout.of(SHAPES["native-cpu"])
    cpu_target = make_cache(SHAPES["native-cpu"], torch.bfloat16, seed=None)
    scatter_blocks(cpu_target, [0, 1], payload, native)
    zeroed = make_cache(SHAPES["house"], torch.bfloat16, seed=None)
    cuda_target = [(k.cuda(), v.cuda()) for k, v in zeroed]
    scatter_blocks(cuda_target, [3, 4], gather_blocks(cpu_target, [0, 1], native))
    assert cuda_target[0][0].device.type == "cuda"
    assert bytes(gather_blocks(cuda_target, [3, 4]).data) == bytes(payload.data)
    assert torch.equal(cuda_target[2][1][4], source[2][1][2])
