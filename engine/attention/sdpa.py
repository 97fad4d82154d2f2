"""The fast torch path: scaled_dot_product_attention over gathered blocks.

Decodes are attended in one batched call: each decode row's blocks are gathered into a
padded `[num_decodes, num_kv_heads, max_len, head_size]` context, and the query heads of
one KV group play the role of the query length, so GQA needs no repeated K/V. Prefill
chunks are attended one sequence at a time (few per step), causal with their offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuda_ext.reference import gather_context
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class SdpaBackend(AttentionBackend):
    """Batched decode + per-sequence prefill through torch SDPA."""

    name = "sdpa"

    def attend(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale):
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], key_cache, value_cache, metadata, scale)
        start = nd
        for i in range(nd, metadata.num_seqs):
            q_len, s_len = metadata.query_lens_cpu[i], metadata.seq_lens_cpu[i]
            table = metadata.block_tables[i]
            out[start : start + q_len] = self._prefill(
                query[start : start + q_len], key_cache, value_cache, table, s_len, scale
            )
            start += q_len
        return out

    @staticmethod
    def _decode(query, key_cache, value_cache, metadata, scale):
        nd, num_heads, head_size = query.shape  # [nd, H, D]
        block_size, kvh = key_cache.shape[1], key_cache.shape[2]
        lens = metadata.seq_lens[:nd]
        max_len = max(metadata.seq_lens_cpu[:nd])
        nblocks = -(-max_len // block_size)
        tables = metadata.block_tables[:nd, :nblocks]  # [nd, nblocks]

        def gather(cache):  # -> [nd, KVH, nblocks * block_size, D]
            ctx = cache[tables].view(nd, nblocks * block_size, kvh, head_size)
            return ctx.transpose(1, 2)

        q = query.view(nd, kvh, num_heads // kvh, head_size)  # [nd, KVH, G, D]
        positions = torch.arange(nblocks * block_size, device=query.device)
        mask = (positions.unsqueeze(0) < lens.unsqueeze(1)).view(nd, 1, 1, -1)
        o = F.scaled_dot_product_attention(
            q, gather(key_cache), gather(value_cache), attn_mask=mask, scale=scale
        )  # [nd, KVH, G, D]
        return o.reshape(nd, num_heads, head_size)

    @staticmethod
    def _prefill(query, key_cache, value_cache, table, s_len, scale):
        q_len, num_heads, head_size = query.shape  # [q_len, H, D]
        kvh = key_cache.shape[2]
        group = num_heads // kvh
        k = gather_context(key_cache, table, s_len).transpose(0, 1)  # [KVH, s_len, D]
        v = gather_context(value_cache, table, s_len).transpose(0, 1)
        # Fold the query heads of each KV group into the query axis: [KVH, G * q_len, D].
        q = query.view(q_len, kvh, group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(kvh, group * q_len, head_size)
        if q_len == s_len:
            mask = torch.ones(q_len, s_len, dtype=torch.bool, device=query.device).tril()
        else:
            q_pos = torch.arange(s_len - q_len, s_len, device=query.device).unsqueeze(1)
            mask = torch.arange(s_len, device=query.device).unsqueeze(0) <= q_pos
        mask = mask.repeat(group, 1)  # [G * q_len, s_len]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.view(kvh, group, q_len, head_size).permute(2, 0, 1, 3)  # [q_len, KVH, G, D]
        return o.reshape(q_len, num_heads, head_size)
