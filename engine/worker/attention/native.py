"""The native CPU backend: cuda_ext's C++ kernels reading K/V blocks in place.

Cache layout, per layer: head-major `[num_blocks, num_kv_heads, block_size, head_size]`
on the CPU (each KV head's rows of a block together: the decode kernel reads them as one
run, about 1.5x the K/V bandwidth of the token-major layout on a 2-core AVX2 machine);
the house layout `[num_blocks, block_size, num_kv_heads, head_size]` on CUDA. A step
writes its new K/V through the slot mapping (`reshape_and_cache`), then attends: the
decode rows (query length 1, first in the batch) in one `paged_attention_decode` call,
the prefill chunks in one `paged_attention_prefill` call; no gathering, no per-sequence
Python loop. Both kernel sets also do the spec's sliding window (reading no block wholly
before it), soft cap and sinks. Copy-on-write copies every layer's blocks in one call.
The CPU kernels also keep the cache in 8 bits (`kv_code`: each row coded as it is
written, and decoded with its scale into registers or a tile's scratch as it is read);
the CUDA kernels read float caches only (the selector refuses them an 8-bit cache).
"""

from __future__ import annotations

import torch

from cuda_ext.kv_quant import KVRowCode
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec


class NativeCpuBackend(AttentionBackend):
    """Paged attention through the compiled CPU kernels (`ops`: a loaded NativeCpuOps)."""

    name = "native"
    block_dim = 0
    index_dtype = torch.int64  # of block tables, lengths and query offsets

    def __init__(self, ops, kv_code: KVRowCode | None = None) -> None:
        super().__init__(kv_code)
        self.ops = ops
        self.kv_format = int(kv_code or 0)  # the kernels' code: 0 a float cache

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_size)

    def write(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        self.ops.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, kv_format=self.kv_format
        )

    def attend(self, query, key_cache, value_cache, metadata: AttentionMetadata, spec, sinks=None):
        self.check_spec(spec)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        nd, caches = metadata.num_decodes, (key_cache, value_cache)
        tables = metadata.block_tables.to(self.index_dtype)  # no copy when already so
        seq_lens = metadata.seq_lens.to(self.index_dtype)
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()  # [num_heads]
        if nd:
            rows = (tables[:nd], seq_lens[:nd])
            self._decode(out[:nd], query[:nd], *caches, *rows, spec, sinks, metadata)
        if nd < metadata.num_seqs:
            starts = (metadata.query_start_loc[nd:] - metadata.query_start_loc[nd]).to(
                self.index_dtype
            )
            rows = (tables[nd:], starts, seq_lens[nd:])
            self._prefill(out[nd:], query[nd:], *caches, *rows, spec, sinks, metadata)
        return out

    def _decode(self, out, query, key_cache, value_cache, tables, seq_lens, spec, sinks, metadata):
        features = _features(spec, sinks)
        self.ops.paged_attention_decode(
            out,
            query,
            key_cache,
            value_cache,
            tables,
            seq_lens,
            spec.scale,
            **features,
            kv_format=self.kv_format,
        )

    def _prefill(
        self, out, query, key_cache, value_cache, tables, starts, seq_lens, spec, sinks, metadata
    ):
        features = _features(spec, sinks)
        self.ops.paged_attention_prefill(
            out,
            query,
            key_cache,
            value_cache,
            tables,
            starts,
            seq_lens,
            spec.scale,
            **features,
            kv_format=self.kv_format,
        )

    def copy_blocks(self, kv_cache, src, dst) -> None:
        """Every layer's K and V blocks src[i] -> dst[i], in one call."""
        mapping = torch.stack([src, dst], dim=1)  # [num_copies, 2]
        keys = [k for k, _ in kv_cache]
        values = [v for _, v in kv_cache]
        self.ops.copy_blocks(keys, values, mapping)

    def swap_blocks(self, src_cache, dst_cache, src, dst) -> None:
        mapping = torch.stack([src, dst], dim=1)  # [num_blocks, 2]
        for (sk, sv), (dk, dv) in zip(src_cache, dst_cache, strict=True):
            self.ops.swap_blocks(sk, dk, mapping)
            self.ops.swap_blocks(sv, dv, mapping)


class NativeCudaBackend(NativeCpuBackend):
    """Paged attention through the CUDA kernels (`kernels`: a loaded CudaKernels): v1
    or v2 decode by context length, the paged prefill kernel, one copy launch for every
    layer. The kernels take int32 block tables and lengths: converted once per layer
    call here (a few hundred bytes). Checked on an H200 (docs/performance.md)."""

    name = "native-cuda"
    index_dtype = torch.int32
    kv_cache_shape = staticmethod(AttentionBackend.kv_cache_shape)  # the house layout

    def write(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def _decode(self, out, query, key_cache, value_cache, tables, seq_lens, spec, sinks, metadata):
        max_len = max(metadata.seq_lens_cpu[: metadata.num_decodes])  # host-side: no sync
        caches, features = (key_cache, value_cache), _features(spec, sinks)
        self.ops.paged_attention(
            out, query, *caches, tables, seq_lens, spec.scale, max_len, **features
        )

    def _prefill(
        self, out, query, key_cache, value_cache, tables, starts, seq_lens, spec, sinks, metadata
    ):
        max_query = max(metadata.query_lens_cpu[metadata.num_decodes :])
        caches, features = (key_cache, value_cache), _features(spec, sinks)
        self.ops.prefill_attention(
            out, query, *caches, tables, starts, seq_lens, spec.scale, max_query, **features
        )


def _features(spec: AttentionSpec, sinks: torch.Tensor | None) -> dict:
    """The CPU kernels' keyword arguments for the spec's optional features."""
    return dict(
        sliding_window=spec.sliding_window or 0, soft_cap=spec.logit_soft_cap or 0.0, sinks=sinks
    )
