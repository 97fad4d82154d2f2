"""The attention backend contract and the always-available reference backend."""

from __future__ import annotations

import torch

from cuda_ext.kv_quant import KVRowCode
from cuda_ext.reference import (
    copy_blocks,
    paged_attention_reference,
    reshape_and_cache,
    swap_blocks,
)
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec


class AttentionBackend:
    """Writes a step's new K/V into the paged cache, then attends over each context.

    Each backend owns its cache layout: `kv_cache_shape` says how one layer's key (and
    value) cache is shaped, `write` stores new K/V through the slot mapping, `attend`
    reads it. `forward` takes the flattened batch and the layer's `AttentionSpec` (scale,
    sliding window, soft cap, sinks) and returns `[num_tokens, num_heads, head_size]`.
    The default layout is the house layout `[num_blocks, block_size, num_kv_heads,
    head_size]`. With `kv_code` the cache is in 8 bits: uint8 rows of head_size codes and
    a float32 scale (cuda_ext/kv_quant.py; `kv_cache_shape` is then given the row's
    width, head_size + 4); `write` codes rows, `attend` reads them. A backend lists the
    optional spec features it cannot do in `unsupported_features`; models are refused at
    start-up rather than attended wrongly.
    """

    name = "base"
    block_dim = 0  # the dimension of kv_cache_shape that indexes blocks
    unsupported_features: frozenset[str] = frozenset()

    def __init__(self, kv_code: KVRowCode | None = None) -> None:
        self.kv_code = kv_code

    def check_spec(self, spec: AttentionSpec) -> None:
        """ValueError naming each feature of `spec` this backend cannot do."""
        missing = [f for f in spec.features if f in self.unsupported_features]
        if missing:
            raise ValueError(
                f"the {self.name!r} attention backend cannot do {' or '.join(missing)}; "
                "choose attention_backend='sdpa' (or 'reference')"
            )

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x kv_cache_shape(...)
        metadata: AttentionMetadata,
        spec: AttentionSpec,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 when spec.has_sinks
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        key_cache, value_cache = kv_cache
        self.write(key, value, key_cache, value_cache, metadata.slot_mapping)
        return self.attend(query, key_cache, value_cache, metadata, spec, sinks)

    def write(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, self.kv_code)

    def copy_blocks(
        self,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x kv_cache_shape
        src: torch.Tensor,  # [num_copies] int64
        dst: torch.Tensor,  # [num_copies] int64
    ) -> None:
        """Copy-on-write: block src[i] -> dst[i] in every layer's K and V cache."""
        for key_cache, value_cache in kv_cache:
            copy_blocks(key_cache, src, dst, self.block_dim)
            copy_blocks(value_cache, src, dst, self.block_dim)

    def swap_blocks(
        self,
        src_cache: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, device or CPU
        dst_cache: list[tuple[torch.Tensor, torch.Tensor]],  # the other one
        src: torch.Tensor,  # [num_blocks] int64 block ids in src_cache
        dst: torch.Tensor,  # [num_blocks] int64 block ids in dst_cache
    ) -> None:
        """Swapping: block src[i] of every layer's K and V cache -> block dst[i] of the
        other cache (device <-> CPU)."""
        for (sk, sv), (dk, dv) in zip(src_cache, dst_cache, strict=True):
            swap_blocks(sk, dk, src, dst, self.block_dim)
            swap_blocks(sv, dv, src, dst, self.block_dim)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        spec: AttentionSpec,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """Plain per-sequence attention in float32 (cuda_ext's oracle). Slow, always right."""

    name = "reference"

    def attend(self, query, key_cache, value_cache, metadata, spec, sinks=None):
        return paged_attention_reference(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            list(metadata.query_lens_cpu),
            list(metadata.seq_lens_cpu),
            spec.scale,
            sliding_window=spec.sliding_window or 0,
            soft_cap=spec.logit_soft_cap or 0.0,
            sinks=sinks,
            kv_code=self.kv_code,
        )
