"""Pure-torch reference kernels: the test oracle and the fallback.

The paged KV cache ops: cache layout (one layer) key_cache, value_cache `[num_blocks,
block_size, num_kv_heads, head_size]` (token-major, the house layout); a slot is
`block_id * block_size + offset`. The native CPU kernels take the head-major layout
`[num_blocks, num_kv_heads, block_size, head_size]`: `head_major` and `token_major`
convert a cache between the two.

The elementwise ops of a Llama decoder layer (RMSNorm, the residual add before it,
SwiGLU's activation, rotary): Hugging Face's math op for op, so each intermediate is
rounded to the input's dtype where transformers rounds it. They return new tensors and
leave their inputs alone; the native versions (`cuda_ext.native_cpu`) write in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuda_ext.kv_quant import KVRowCode, dequantize_rows, quantize_rows


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, num_kv_heads, head_size] -> a contiguous
    [num_blocks, num_kv_heads, block_size, head_size] copy."""
    return cache.transpose(1, 2).contiguous()


def token_major(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, num_kv_heads, block_size, head_size] -> a contiguous
    [num_blocks, block_size, num_kv_heads, head_size] copy."""
    return cache.transpose(1, 2).contiguous()


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_code: KVRowCode | None = None,  # an 8-bit cache (uint8 rows of head_size + 4)
) -> None:
    """Write each token's K/V into its slot. Slots < 0 are padding and are skipped. An
    8-bit cache (`kv_code`) gets each row coded with its scale (cuda_ext/kv_quant.py)."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key/value must be [T, kv_heads, head]; got {key.shape}, {value.shape}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens"
        )
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_code is not None:
        key, value = quantize_rows(key, kv_code), quantize_rows(value, kv_code)
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_blocks_of_seq] int64
    seq_len: int,
    kv_code: KVRowCode | None = None,  # an 8-bit cache: rows decoded to float32
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_size]
    """The first `seq_len` tokens of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])
    rows = blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]
    return rows if kv_code is None else dequantize_rows(rows, kv_code)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int64
    query_lens: list[int],  # per sequence, sums to num_tokens
    seq_lens: list[int],  # per sequence: context length including this step's tokens
    scale: float,
    *,
    sliding_window: int = 0,  # 0: none; W: a query at p sees keys p - W < j <= p
    soft_cap: float = 0.0,  # 0: none; c: scores -> c * tanh(scores / c) before the mask
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits added to each denominator
    kv_code: KVRowCode | None = None,  # 8-bit caches: [..., head_size + 4] uint8 rows
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Causal attention of each sequence's new tokens over its paged context.

    The query tokens of a sequence are its last `query_len` positions, so query i sits at
    position `seq_len - query_len + i` and sees keys at positions <= that (and, with a
    sliding window, > position - W: blocks wholly before the window are never read, so
    their table entries may be anything). Works for any mix of prefill chunks and
    decodes, GQA/MQA and any block size. Math in float32. 8-bit caches (`kv_code`) are
    read as their decoded rows (cuda_ext/kv_quant.py).
    """
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first = max(0, s_len - q_len - sliding_window + 1) if sliding_window else 0
        skip = first // block_size * block_size  # whole blocks before the window: unread
        table = block_tables[i][skip // block_size :]
        q = query[start : start + q_len].float()  # [q_len, H, D]
        k = gather_context(key_cache, table, s_len - skip, kv_code).float()  # [L, KVH, D]
        v = gather_context(value_cache, table, s_len - skip, kv_code).float()
        k = k.repeat_interleave(group, dim=1)  # [s_len - skip, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, s_len - skip]
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
        k_pos = torch.arange(skip, s_len).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        start += q_len
    return out


def copy_blocks(
    cache: torch.Tensor,  # one layer's key or value cache, blocks along `block_dim`
    src: torch.Tensor,  # [num_copies] int64 block ids
    dst: torch.Tensor,  # [num_copies] int64 block ids, distinct, none of them in src
    block_dim: int = 0,
) -> None:
    """Copies whole blocks src[i] -> dst[i] (copy-on-write), all of them in one op."""
    cache.index_copy_(block_dim, dst, cache.index_select(block_dim, src))


def swap_blocks(
    src_cache: torch.Tensor,  # one layer's K or V cache (device or CPU), blocks on block_dim
    dst_cache: torch.Tensor,  # the same layout on the other side
    src: torch.Tensor,  # [num_blocks] int64 block ids in src_cache
    dst: torch.Tensor,  # [num_blocks] int64 block ids in dst_cache
    block_dim: int = 0,
) -> None:
    """Copies blocks src[i] of one cache into blocks dst[i] of another (swap out / in)."""
    moved = src_cache.index_select(block_dim, src.to(src_cache.device))
    dst_cache.index_copy_(block_dim, dst.to(dst_cache.device), moved.to(dst_cache.device))


def rms_norm(
    x: torch.Tensor,  # [..., hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> torch.Tensor:  # [..., hidden_size]
    """HF LlamaRMSNorm: the norm in float32, rounded to x's dtype, then times weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden_size], a sublayer's output
    residual: torch.Tensor,  # [..., hidden_size], the residual stream
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalized, new residual), both [..., hidden_size]
    """The residual add before a pre-norm: `residual + x` (in x's dtype), normalized."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
    """SwiGLU's activation: silu(gate) * up, for gate_up = [gate | up] on the last dim."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos: torch.Tensor,  # [max_positions, head_size]: cos of [angles | angles]
    sin: torch.Tensor,  # [max_positions, head_size]: sin of [angles | angles]
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (query, key), same shapes
    """Rotate-half (GPT-NeoX) rotary: x * cos + rotate_half(x) * sin, with the tables
    rounded to the heads' dtype. A table row repeats its angles in both halves."""
    cos = cos[positions].unsqueeze(1).to(query.dtype)  # [num_tokens, 1, head_size]
    sin = sin[positions].unsqueeze(1).to(query.dtype)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., head_size]: [-x2 | x1]
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
