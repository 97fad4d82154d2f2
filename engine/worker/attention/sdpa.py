"""The fast torch path: scaled_dot_product_attention over gathered blocks.

Cache layout (one layer, keys and values alike): head-major
`[num_kv_heads, num_blocks, block_size, head_size]`, so gathering a sequence's blocks
with one `index_select` on dim 1 yields each head's context contiguous, which SDPA
reads at full speed.

Decodes (query length 1) are sorted by context length and attended in buckets of
`DECODE_BUCKET` rows, each padded only to its own longest context; the query heads of a
KV group stand in for the query axis, so GQA needs no repeated K/V. Prefill chunks are
attended one sequence at a time, causal with their offset. A sliding window is a mask,
and blocks wholly before every row's window are not gathered; layers with soft-capped
logits or sinks take an explicit softmax (`_attention`). Gathers go into a reused
workspace: fresh multi-MB buffers every layer would cost more in page faults than the
copy itself. An 8-bit cache (`kv_code`) is gathered as coded rows and decoded to the
query's dtype before SDPA reads it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cuda_ext.kv_quant import KVRowCode, dequantize_rows, quantize_rows
from engine.kv.block_count import cdiv
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec

DECODE_BUCKET = 32


class Workspace:
    """Scratch buffers reused across layers and steps (grown, never shrunk)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


class SdpaBackend(AttentionBackend):
    """Bucketed batched decode + per-sequence prefill through torch SDPA."""

    name = "sdpa"
    block_dim = 1

    def __init__(self, kv_code: KVRowCode | None = None) -> None:
        super().__init__(kv_code)
        self.workspace = Workspace()

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_kv_heads, num_blocks, block_size, head_size)

    def write(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        kvh, _, _, head_size = key_cache.shape  # an 8-bit cache: the coded row's width
        if self.kv_code is not None:
            key, value = quantize_rows(key, self.kv_code), quantize_rows(value, self.kv_code)
        # [T, KVH, D] -> [KVH, T, D] into [KVH, num_blocks * block_size, D] at the slots.
        key_cache.view(kvh, -1, head_size).index_copy_(1, slot_mapping, key.transpose(0, 1))
        value_cache.view(kvh, -1, head_size).index_copy_(1, slot_mapping, value.transpose(0, 1))

    def attend(self, query, key_cache, value_cache, metadata: AttentionMetadata, spec, sinks=None):
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd:
            lens = metadata.seq_lens_cpu
            order = sorted(range(nd), key=lens.__getitem__)
            for i in range(0, nd, DECODE_BUCKET):
                rows = order[i : i + DECODE_BUCKET]
                out[rows] = self._decode(query, key_cache, value_cache, metadata, rows, spec, sinks)
        start = nd
        for i in range(nd, metadata.num_seqs):
            q_len, s_len = metadata.query_lens_cpu[i], metadata.seq_lens_cpu[i]
            out[start : start + q_len] = self._prefill(
                query[start : start + q_len],
                key_cache,
                value_cache,
                metadata.block_tables[i],
                s_len,
                spec,
                sinks,
            )
            start += q_len
        return out

    def _gather(self, name, cache, tables, like) -> torch.Tensor:
        """`tables` [rows, nblocks] -> contexts [KVH, rows, nblocks * block_size, D] in
        `like`'s dtype (an 8-bit cache's rows gathered, then decoded)."""
        kvh, _, block_size, width = cache.shape
        rows, nblocks = tables.shape
        buf = self.workspace.get(name, (kvh, rows * nblocks, block_size, width), cache)
        torch.index_select(cache, 1, tables.reshape(-1), out=buf)
        if self.kv_code is not None:
            buf = dequantize_rows(buf, self.kv_code).to(like.dtype)
        return buf.view(kvh, rows, nblocks * block_size, buf.shape[-1])

    def _decode(self, query, key_cache, value_cache, metadata, rows, spec, sinks):
        num_heads, head_size = query.shape[1], query.shape[2]
        kvh, block_size = key_cache.shape[0], key_cache.shape[2]
        lens = [metadata.seq_lens_cpu[r] for r in rows]
        first = min(spec.first_visible(n - 1) for n in lens) // block_size  # first block read
        nblocks = cdiv(max(lens), block_size)
        index = torch.tensor(rows, device=query.device)
        tables = metadata.block_tables[index, first:nblocks]  # [rows, nblocks - first]
        k = self._gather("k", key_cache, tables, query)
        v = self._gather("v", value_cache, tables, query)
        q = query[index].view(len(rows), kvh, num_heads // kvh, head_size).transpose(0, 1)
        positions = torch.arange(first * block_size, nblocks * block_size, device=query.device)
        seq_lens = metadata.seq_lens[index].unsqueeze(1)
        mask = positions.unsqueeze(0) < seq_lens  # [rows, context]
        if spec.sliding_window is not None:
            mask &= positions.unsqueeze(0) > seq_lens - 1 - spec.sliding_window
        head_sinks = None if sinks is None else sinks.view(kvh, 1, num_heads // kvh, 1)
        o = _attention(q, k, v, mask.view(1, len(rows), 1, -1), spec, head_sinks)
        return o.transpose(0, 1).reshape(len(rows), num_heads, head_size)  # o: [KVH, rows, G, D]

    def _prefill(self, query, key_cache, value_cache, table, s_len, spec, sinks):
        q_len, num_heads, head_size = query.shape  # [q_len, H, D]
        kvh, block_size = key_cache.shape[0], key_cache.shape[2]
        group = num_heads // kvh
        first = spec.first_visible(s_len - q_len) // block_size
        tables = table[first : cdiv(s_len, block_size)].unsqueeze(0)
        skip = first * block_size
        k = self._gather("k", key_cache, tables, query)[:, 0, : s_len - skip]  # [KVH, L, D]
        v = self._gather("v", value_cache, tables, query)[:, 0, : s_len - skip]
        # Fold the query heads of each KV group into the query axis: [KVH, G * q_len, D].
        q = query.view(q_len, kvh, group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(kvh, group * q_len, head_size)
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(skip, s_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos  # [q_len, L]
        if spec.sliding_window is not None:
            mask &= k_pos > q_pos - spec.sliding_window
        head_sinks = None
        if sinks is not None:  # [H] -> one per row of q: [KVH, G * q_len, 1]
            head_sinks = sinks.view(kvh, group, 1, 1).expand(kvh, group, q_len, 1)
            head_sinks = head_sinks.reshape(kvh, group * q_len, 1)
        o = _attention(q, k, v, mask.repeat(group, 1), spec, head_sinks)
        o = o.view(kvh, group, q_len, head_size).permute(2, 0, 1, 3)  # [q_len, KVH, G, D]
        return o.reshape(q_len, num_heads, head_size)


def _attention(
    q: torch.Tensor,  # [..., queries, D]
    k: torch.Tensor,  # [..., keys, D]
    v: torch.Tensor,  # [..., keys, D]
    mask: torch.Tensor,  # bool, broadcastable to [..., queries, keys]: True = visible
    spec: AttentionSpec,
    sinks: torch.Tensor | None,  # broadcastable to [..., queries, 1]: per-head sink logits
) -> torch.Tensor:  # [..., queries, D]
    """SDPA, or (soft cap, sinks) the same attention written out, softmax in float32."""
    if spec.logit_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * spec.scale
    if spec.logit_soft_cap is not None:
        scores = spec.logit_soft_cap * torch.tanh(scores / spec.logit_soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
