"""Shared cases of the CUDA kernel tests: paged caches whose unowned slots hold NaN, the
reference they are checked against, and the tolerances."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from cuda_ext import native_cuda, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 80, 96, 128, 112, 256]  # the last two take the generic path
BLOCK_SIZES = [8, 16, 32]
HEADS = [(8, 8), (8, 2), (8, 1)]  # (num_heads, num_kv_heads): MHA, GQA 4:1, MQA
TOLERANCE = {  # float32 math in both; the difference is summation order and rounding
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 2e-2},
}
DEVICE = torch.device("cuda")


@dataclass(frozen=True)
class PagedKV:
    """One layer's caches holding `seq_lens` tokens per sequence, and their block tables."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with a NaN block
    seq_lens: list[int]

    @property
    def seq_lens_tensor(self) -> torch.Tensor:  # [num_seqs] int32
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE)


def make_paged_kv(
    seq_lens: list[int], num_kv_heads: int, head_size: int, block_size: int, dtype
) -> PagedKV:
    blocks = [native_cuda.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2  # two spare blocks, never in a context
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, device=DEVICE).to(dtype)
    value_cache = torch.randn(shape, device=DEVICE).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    spare = order[-1]
    tables = torch.full((len(seq_lens), max(blocks, default=1)), spare, dtype=torch.int32)
    for i, (n_blocks, n_tokens) in enumerate(zip(blocks, seq_lens, strict=True)):
        tables[i, :n_blocks] = torch.tensor(order[:n_blocks])
        order = order[n_blocks:]
        if n_blocks:  # the last block's tail
            tail = n_tokens - (n_blocks - 1) * block_size
            last = int(tables[i, n_blocks - 1])
            key_cache[last, tail:] = float("nan")
            value_cache[last, tail:] = float("nan")
    for block in order:  # the spares
        key_cache[block] = float("nan")
        value_cache[block] = float("nan")
    return PagedKV(key_cache, value_cache, tables.to(DEVICE), list(seq_lens))


def expected_attention(query, kv: PagedKV, query_lens: list[int], scale: float, **features):
    """The reference's output; `features`: its sliding_window, soft_cap and sinks."""
    return reference.paged_attention_reference(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables.long(),
        query_lens,
        kv.seq_lens,
        scale,
        **features,
    )


def grid(*axes):
    return list(itertools.product(*axes))


def loaded_kernels() -> native_cuda.CudaKernels:
    """The built kernels; fails the test where CUDA is present but the build broke."""
    loaded = native_cuda.load_cuda_kernels()
    if loaded is None:
        pytest.fail(native_cuda.cuda_unavailable_reason())
    return loaded
