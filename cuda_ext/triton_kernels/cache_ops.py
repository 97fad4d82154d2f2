"""Cache writes and block copies in Triton (house layout `[num_blocks, block_size,
num_kv_heads, head_size]`; the semantics of `cuda_ext.reference`'s functions)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuda_ext.triton_kernels.kernel import check_device, next_power_of_2

COPY_CHUNK = 1024  # elements of a block one program copies


@triton.jit
def _reshape_and_cache(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    block_size,
    row_size,
    stride_kt,
    stride_vt,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    ROW_P2: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding
        return
    block = slot // block_size
    offset = slot % block_size
    i = tl.arange(0, ROW_P2)  # [num_kv_heads * head_size] of the token's row
    ok = i < row_size
    k = tl.load(key_ptr + token * stride_kt + i, mask=ok)
    v = tl.load(value_ptr + token * stride_vt + i, mask=ok)
    tl.store(key_cache_ptr + block * stride_kb + offset * stride_ks + i, k, mask=ok)
    tl.store(value_cache_ptr + block * stride_vb + offset * stride_vs + i, v, mask=ok)


@triton.jit
def _copy_blocks(cache_ptr, src_ptr, dst_ptr, block_elems, stride_b, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    i = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = i < block_elems
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    block = tl.load(cache_ptr + src * stride_b + i, mask=ok)
    tl.store(cache_ptr + dst * stride_b + i, block, mask=ok)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0: padding, skipped
) -> None:
    """Writes each token's K/V row into its slot."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key/value must be [T, kv_heads, head]; got {key.shape}, {value.shape}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens"
        )
    if key.shape[0] == 0:
        return
    key, value = _rows(key), _rows(value)
    for cache in (key_cache, value_cache):
        if not _slots_contiguous(cache):
            raise ValueError("a cache's [num_kv_heads, head_size] rows must be contiguous")
    row = key.shape[1] * key.shape[2]
    check_device(key.device)
    _reshape_and_cache[(key.shape[0],)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key_cache.shape[1],
        row,
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        ROW_P2=next_power_of_2(row),
    )


def copy_blocks(
    cache: torch.Tensor,  # one layer's key or value cache, blocks on dimension 0
    src: torch.Tensor,  # [num_copies] int64
    dst: torch.Tensor,  # [num_copies] int64, distinct, none of them in src
) -> None:
    """Copies whole blocks src[i] -> dst[i] (copy-on-write)."""
    if src.shape != dst.shape:
        raise ValueError(f"{src.shape[0]} sources for {dst.shape[0]} destinations")
    if src.shape[0] == 0:
        return
    if not cache[0].is_contiguous():
        raise ValueError("copy_blocks needs each block contiguous (blocks on dimension 0)")
    block_elems = cache[0].numel()
    grid = (src.shape[0], -(-block_elems // COPY_CHUNK))
    check_device(cache.device)
    _copy_blocks[grid](cache, src, dst, block_elems, cache.stride(0), CHUNK=COPY_CHUNK)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, kv_heads, head] with each token's row contiguous (a copy if it is not)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _slots_contiguous(cache: torch.Tensor) -> bool:
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]
