"""A linear-attention layer's states in KV cache pages: a state fills the layer's K page
then its V page, in any cache layout and dtype, and leaves other pages alone."""

from __future__ import annotations

import pytest
import torch

from engine.worker.recurrent_state import RecurrentStatePages, state_block_size

RECURRENT, CONV = (4, 16, 16), (192, 3)  # 4096 + 2304 bytes of float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["house", "heads-first"])
def test_states_round_trip_through_pages_and_touch_no_other_page(dtype, layout):
    block_size = state_block_size(4 * (4 * 16 * 16 + 192 * 3), 2, 16, dtype)
    shape = (6, block_size, 2, 16) if layout == "house" else (2, 6, block_size, 16)
    block_dim = 0 if layout == "house" else 1
    kv = tuple(torch.full(shape, float("nan"), dtype=dtype) for _ in "kv")
    pages = RecurrentStatePages(kv, RECURRENT, CONV, block_dim)
    conv, recurrent = torch.randn(2, *CONV), torch.randn(2, *RECURRENT)
    pages.write(torch.tensor([4, 1]), conv, recurrent)
    got_conv, got_recurrent = pages.read(torch.tensor([1, 4]))
    assert torch.equal(got_conv, conv.flip(0)) and torch.equal(got_recurrent, recurrent.flip(0))
    for t in kv:
        for untouched in (0, 2, 3, 5):
            assert t.select(block_dim, untouched).isnan().all()


def test_a_page_too_small_for_a_state_is_refused_with_the_remedy():
    kv = tuple(torch.zeros(3, 8, 2, 16) for _ in "kv")  # 2 x 1 KiB pages
    with pytest.raises(ValueError, match="does not fit .* raise block_size"):
        RecurrentStatePages(kv, RECURRENT, CONV)


def test_the_smallest_block_size_holds_the_state_in_multiples_of_16():
    assert state_block_size(6400, 2, 16, torch.float32) == 32  # 256 bytes per token
    assert state_block_size(256, 2, 16, torch.float32) == 16
