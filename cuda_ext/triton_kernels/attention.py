"""Unified paged attention in Triton: decode rows and prefill chunks in one launch.

A program takes one tile of `BLOCK_Q` query tokens of one sequence and one KV head,
with the `GROUP` query heads that share it (GQA): `BLOCK_Q * GROUP_P2` rows. It walks
the sequence's context in tiles of `TILE_N` positions, reading each position's block
through the block table (so any block size works, and a tile may span blocks), and
keeps an online softmax (running max, denominator and output) in float32. The query
token at index i of a sequence with `q_len` new tokens and context `seq_len` sits at
position `seq_len - q_len + i` and sees the keys at positions <= that (and, with a
sliding window W, > position - W: tiles wholly before the window are not read). Soft
capping scores `cap * tanh(s / cap)` before the mask; sinks add `exp(sink)` to each
head's denominator. Math matches `cuda_ext.reference.paged_attention_reference`.

Under Triton's interpreter (3.9) `tl.dot` misreads bfloat16 operands, so there (only)
bfloat16 tiles are widened to float32 before each product (`WIDEN`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuda_ext.triton_kernels.kernel import check_device, interpreting, next_power_of_2

TILE_N = 32  # context positions per inner step (tl.dot wants >= 16)
MIN_ROWS = 16  # query rows per program, at least (tl.dot wants >= 16)
PREFILL_ROWS = 64  # query rows per program when the step has prefill chunks


@triton.jit
def _unified_attention(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale,
    soft_cap,
    num_q_tiles,
    block_size,
    head_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_P2: tl.constexpr,
    TILE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    seq = tl.program_id(0) // num_q_tiles
    tile = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    q_idx = tile * BLOCK_Q + rows // GROUP_P2  # [M] the row's token, within the sequence
    head = kv_head * GROUP + rows % GROUP_P2  # [M] its query head
    row_ok = (q_idx < q_len) & (rows % GROUP_P2 < GROUP)
    d = tl.arange(0, HEAD_P2)
    d_ok = d < head_size
    q_offs = (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    q_pos = context + q_idx  # [M]

    end = tl.minimum(context + (tile + 1) * BLOCK_Q, seq_len)  # keys past it: masked for all
    begin = 0
    if SLIDING_WINDOW > 0:
        begin = tl.maximum(context + tile * BLOCK_Q - SLIDING_WINDOW + 1, 0) // TILE * TILE

    m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, HEAD_P2], tl.float32)
    for start in range(begin, end, TILE):
        pos = start + tl.arange(0, TILE)  # [N] context positions
        pos_ok = pos < end
        table = block_tables_ptr + seq * stride_bt
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0)
        slot = pos % block_size
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k_offs = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_offs + d[None, :], mask=kv_ok, other=0.0)  # [N, D]
        if WIDEN:  # the interpreter's tl.dot misreads bfloat16 operands
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif IEEE:  # float32 operands: full precision, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [M, N]
        if USE_SOFT_CAP:  # cap * tanh(s / cap); tanh|x| = (1 - e^-2|x|) / (1 + e^-2|x|)
            x = s / soft_cap
            e = tl.exp(-2.0 * tl.abs(x))
            s = soft_cap * tl.where(x < 0, (e - 1.0) / (1.0 + e), (1.0 - e) / (1.0 + e))
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp(s - m_safe[:, None])  # [M, N]
        alpha = tl.exp(m_i - m_safe)
        v_offs = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_offs + d[None, :], mask=kv_ok, other=0.0)  # [N, D]
        if WIDEN:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    if USE_SINKS:  # one more "key" per head scoring its sink, with a zero value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - m_safe)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # masked rows: never stored
    out = acc / l_i[:, None]
    o_offs = (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_ok = row_ok[:, None] & d_ok[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_ok)


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, context including this step's tokens
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int = 0,  # 0: none
    soft_cap: float = 0.0,  # 0: none
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context, into
    `out` (returned). The caches' last dimension must be contiguous."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    for name, t in (("query", query), ("out", out), ("key_cache", key_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    group = num_heads // num_kv_heads
    group_p2 = next_power_of_2(group)
    rows = PREFILL_ROWS if max_query_len > 1 else MIN_ROWS
    block_q = max(1, rows // group_p2)
    num_q_tiles = -(-max_query_len // block_q)
    value_cache = value_cache if value_cache.stride(-1) == 1 else value_cache.contiguous()
    sinks_arg = sinks if sinks is not None else query  # never read without sinks
    check_device(query.device)
    _unified_attention[(num_seqs * num_q_tiles, num_kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        sinks_arg,
        float(scale),
        float(soft_cap) or 1.0,
        num_q_tiles,
        block_size,
        head_size,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=block_q,
        HEAD_P2=max(16, next_power_of_2(head_size)),
        TILE=TILE_N,
        SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=bool(soft_cap),
        USE_SINKS=sinks is not None,
        IEEE=query.dtype == torch.float32,
        WIDEN=interpreting() and query.dtype == torch.bfloat16,
    )
    return out
