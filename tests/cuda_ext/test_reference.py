"""The pure-torch oracle kernels against dense, unpaged attention."""

from __future__ import annotations

import pytest
import torch

from cuda_ext.reference import paged_attention_reference, reshape_and_cache


def test_reshape_and_cache_writes_slots_and_skips_padding():
    key_cache = torch.zeros(4, 2, 1, 3)
    value_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    reshape_and_cache(key, -key, key_cache, value_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(key_cache[2, 1, 0], key[0, 0])  # slot 5 = block 2, offset 1
    assert torch.equal(key_cache[0, 0, 0], key[2, 0])
    assert torch.equal(value_cache[2, 1, 0], -key[0, 0])
    assert key_cache.count_nonzero() == 5  # key[0] has one zero; the padded token wrote nothing


def test_reshape_and_cache_rejects_mismatched_shapes():
    cache = torch.zeros(2, 2, 1, 3)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(
            torch.zeros(2, 1, 3), torch.zeros(2, 1, 3), cache, cache, torch.tensor([0])
        )


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_paged_equals_dense_causal_attention_with_gqa(block_size):
    torch.manual_seed(0)
    seq_len, q_len, heads, kv_heads, head = 11, 4, 4, 2, 8
    k = torch.randn(seq_len, kv_heads, head)
    v = torch.randn(seq_len, kv_heads, head)
    q = torch.randn(q_len, heads, head)
    num_blocks = -(-seq_len // block_size)
    table = torch.randperm(num_blocks + 3)[:num_blocks]
    key_cache = torch.zeros(num_blocks + 3, block_size, kv_heads, head)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    )
    reshape_and_cache(k, v, key_cache, value_cache, slots)
    got = paged_attention_reference(
        q, key_cache, value_cache, table.view(1, -1), [q_len], [seq_len], head**-0.5
    )
    # Dense: the queries are the last q_len positions of the sequence.
    kk = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, S, D]
    vv = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk, vv, attn_mask=mask
    ).transpose(0, 1)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
