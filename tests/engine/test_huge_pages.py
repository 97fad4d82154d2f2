"""The CPU KV cache's memory: zeroed, contiguous, 2 MiB-aligned when large (so Linux's
`madvise` THP mode can back it with huge pages), plain torch.zeros when small."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.worker.huge_pages import HUGE_PAGE, zeros_on_huge_pages


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_tensors_are_zeroed_contiguous_and_aligned(dtype):
    shape = (33, 16, 8, 64 * 17)  # a little over 2 MiB per tensor in 2-byte types
    tensor = zeros_on_huge_pages(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    if sys.platform.startswith("linux"):
        assert tensor.data_ptr() % HUGE_PAGE == 0
    tensor[-1, -1, -1, -1] = 1  # the whole range is writable
    assert tensor.sum().item() == 1


@pytest.mark.timeout(60)
def test_small_tensors_are_plain_zeros():
    tensor = zeros_on_huge_pages((4, 16, 2, 8), torch.float32)
    assert tensor.shape == (4, 16, 2, 8) and not tensor.any()
    assert tensor.untyped_storage().nbytes() == tensor.numel() * 4
