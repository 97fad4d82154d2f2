"""The Triton backend: cuda_ext's Triton kernels over the house cache layout.

A step writes its new K/V through the slot mapping (`reshape_and_cache`), then one
launch of the unified kernel attends every row, decodes and prefill chunks alike, with
the spec's sliding window, soft cap and sinks. Copy-on-write runs one block-copy launch
per cache tensor; swapping between the device and the CPU stays torch's copy. Float
caches only (no 8-bit `kv_cache_dtype`). Compiled on CUDA; on the CPU only under
`TRITON_INTERPRET=1` (Triton's interpreter: slow, for checking the kernels).
"""

from __future__ import annotations

import torch

from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec


class TritonBackend(AttentionBackend):
    """Paged attention through `cuda_ext.triton_kernels` (house layout, float caches)."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__(None)
        from cuda_ext import triton_kernels

        self.kernels = triton_kernels

    def write(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        self.kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        spec: AttentionSpec,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()  # [num_heads]
        return self.kernels.paged_attention(
            torch.empty_like(query),
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            max(metadata.query_lens_cpu, default=0),
            spec.scale,
            sliding_window=spec.sliding_window or 0,
            soft_cap=spec.logit_soft_cap or 0.0,
            sinks=sinks,
        )

    def copy_blocks(self, kv_cache, src, dst) -> None:
        for key_cache, value_cache in kv_cache:
            self.kernels.copy_blocks(key_cache, src, dst)
            self.kernels.copy_blocks(value_cache, src, dst)
