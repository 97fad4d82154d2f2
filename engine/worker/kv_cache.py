"""Sizing and allocating the paged KV cache tensors."""

from __future__ import annotations

import logging

import torch

from cuda_ext.kv_quant import KVRowCode, row_width
from engine.config import CacheConfig, KVCacheDtype, ModelConfig
from engine.worker.huge_pages import zeros_on_huge_pages
from engine.worker.parallel.layers import kv_heads_per_rank

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key_cache, value_cache)


class KVCacheTooSmallError(ValueError):
    """The memory budget cannot hold even one sequence of max_model_len tokens."""


def cache_tensors_per_layer_set(model: ModelConfig, layers: int | None = None) -> int:
    """How many per-layer (K, V) tensor pairs the cache holds: one per layer (`layers`:
    a pipeline stage's; None: the model's), or, for a hybrid layout, one per layer of a
    group (groups share them: kv_cache_groups.py)."""
    layout = model.kv_cache_layout
    return layout.layers_per_group if layout.is_hybrid else layers or model.num_layers


def row_code(cache_dtype: KVCacheDtype) -> KVRowCode | None:
    """How an 8-bit cache codes its rows (the code of the same name); None for a cache
    in the model's dtype."""
    return KVRowCode[cache_dtype.name] if cache_dtype.is_8bit else None


def cache_storage(model: ModelConfig, cache_dtype: KVCacheDtype) -> tuple[torch.dtype, int]:
    """The cache tensors' dtype and the elements of one (token, KV head) row: the model's
    dtype and head_size, or uint8 and head_size + 4 (codes, then the row's float32 scale)."""
    if row_code(cache_dtype) is None:
        return model.dtype, model.head_size
    return torch.uint8, row_width(model.head_size)


def cache_dtype_name(model: ModelConfig, cache_dtype: KVCacheDtype) -> str:
    """What the cache stores, as logged and reported: "float32", "int8", "fp8_e4m3", ..."""
    if cache_dtype is KVCacheDtype.AUTO:
        return str(model.dtype).removeprefix("torch.")
    return cache_dtype.value


def block_bytes(
    model: ModelConfig,
    block_size: int,
    world_size: int = 1,
    cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    layers: int | None = None,
) -> int:
    """Bytes of one block (a page: its slots in every cache tensor), keys and values, on
    one of `world_size` tensor-parallel ranks (each caches its own key/value heads), in
    `cache_dtype` (an 8-bit row also holds its scale), for `layers` layers (a pipeline
    stage's; None: all)."""
    heads = kv_heads_per_rank(model.num_kv_heads, world_size)
    dtype, width = cache_storage(model, cache_dtype)
    per_token = 2 * cache_tensors_per_layer_set(model, layers) * heads * width
    return per_token * block_size * dtype.itemsize


def reserved_blocks(model: ModelConfig) -> int:
    """Pages the allocator keeps for itself: the hybrid layout's null block."""
    return 1 if model.kv_cache_layout.is_hybrid else 0


def num_blocks_for(
    model: ModelConfig,
    cache: CacheConfig,
    budget_bytes: int,
    world_size: int = 1,
    max_chunk: int | None = None,
    layers: int | None = None,
) -> int:
    """How many blocks fit in `budget_bytes` (one rank's of `world_size`); raises when
    one full sequence, computed in chunks of at most `max_chunk` tokens (the step's
    token budget; None: in one), does not fit."""
    per_block = block_bytes(model, cache.block_size, world_size, cache.cache_dtype, layers)
    num_blocks = max(0, budget_bytes // per_block - reserved_blocks(model))
    needed = model.kv_cache_layout.max_blocks_per_sequence(
        model.max_model_len, max_chunk or model.max_model_len, cache.block_size
    )
    if num_blocks < needed:
        mib = 1024**2
        raise KVCacheTooSmallError(
            f"the KV cache budget of {budget_bytes / mib:.1f} MiB holds {num_blocks} blocks of "
            f"{cache.block_size} tokens ({per_block / mib:.3f} MiB each), but one sequence of "
            f"max_model_len={model.max_model_len} tokens needs {needed} blocks "
            f"({needed * per_block / mib:.1f} MiB); raise kv_cache_memory or "
            "gpu_memory_utilization (CUDA without kv_cache_memory), or lower max_model_len"
        )
    concurrency = num_blocks * cache.block_size / model.max_model_len
    logger.info(
        "KV cache: %d blocks x %d tokens (%.1f MiB of %s); max concurrency %.2fx at %d "
        "tokens/request",
        num_blocks,
        cache.block_size,
        num_blocks * per_block / 1024**2,
        cache_dtype_name(model, cache.cache_dtype),
        concurrency,
        model.max_model_len,
    )
    return int(num_blocks)


def cuda_budget_bytes(cache: CacheConfig, peak_bytes: int, device: torch.device) -> int:
    """gpu_memory_utilization x total memory, minus what weights and activations peaked at."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * cache.gpu_memory_utilization) - peak_bytes


def allocate_kv_cache(
    model: ModelConfig,
    shape: tuple[int, ...],
    device: str,
    pinned: bool = False,
    dtype: torch.dtype | None = None,
    layers: int | None = None,
) -> KVCache:
    """Per layer, zeroed K and V caches of the attention backend's `shape` (the blocks
    the scheduler hands out plus `reserved_blocks`) in `dtype` (None: the model's; uint8
    for an 8-bit cache, `cache_storage`); on the CPU, on transparent huge
    pages where the system allows (engine/worker/huge_pages.py), or in pinned memory
    (`pinned`: the swap space of a CUDA device, which the copies need). With a hybrid layout
    the layers of different groups share tensors: layer `groups[g].layers[j]` gets
    tensor pair j (`KVCacheLayout.place`). `layers`: a pipeline stage's layer count (its
    own layers only; None: the model's)."""

    dtype = dtype or model.dtype

    def zeros() -> torch.Tensor:
        if pinned:
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        if str(device) == "cpu":
            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    pairs = [(zeros(), zeros()) for _ in range(cache_tensors_per_layer_set(model, layers))]
    layout = model.kv_cache_layout
    if not layout.is_hybrid:
        return pairs
    return [pairs[layout.place(layer)[1]] for layer in range(model.num_layers)]


def distinct_tensors(kv_cache: KVCache) -> KVCache:
    """Each (K, V) pair once (layers of a hybrid layout share them): what block copies
    and swaps must move."""
    return list({id(pair[0]): pair for pair in kv_cache}.values())
