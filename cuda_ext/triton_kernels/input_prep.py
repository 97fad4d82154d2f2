"""A step's flattened model input built on the device from persistent buffers.

`tokens[slot, p]` holds request `slot`'s known token at position p and `tables[slot, i]`
its block table (with G KV cache groups, entry `i * G + g` is group g's block i). Given,
per batch row, its slot, the tokens it computed before this step, how many it computes
now and where its tokens start in the batch, one launch writes every token's input id,
position and, per group, KV slot (`block * block_size + offset`): what the host builder
(`engine.worker.input_batch.build_model_input`) computes token by token in Python.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuda_ext.triton_kernels.kernel import check_device

TOKENS_PER_PROGRAM = 128


@triton.jit
def _prepare_inputs(
    tokens_ptr,
    tables_ptr,
    slots_ptr,
    computed_ptr,
    counts_ptr,
    starts_ptr,
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    stride_tokens,
    stride_tables,
    block_size,
    num_groups,
    num_tokens,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < tl.load(counts_ptr + row)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(computed_ptr + row).to(tl.int64) + j  # [BLOCK] positions
    out = tl.load(starts_ptr + row).to(tl.int64) + j  # [BLOCK] places in the batch
    token = tl.load(tokens_ptr + slot * stride_tokens + pos, mask=ok)
    tl.store(input_ids_ptr + out, token.to(tl.int64), mask=ok)
    tl.store(positions_ptr + out, pos, mask=ok)
    entry = (pos // block_size) * num_groups
    for g in range(num_groups):
        block = tl.load(tables_ptr + slot * stride_tables + entry + g, mask=ok).to(tl.int64)
        kv_slot = block * block_size + pos % block_size
        tl.store(slot_mapping_ptr + g * num_tokens + out, kv_slot, mask=ok)


def prepare_inputs(
    tokens: torch.Tensor,  # [num_slots, max_model_len] int32, known tokens per slot
    tables: torch.Tensor,  # [num_slots, max_entries] int32, block tables per slot
    slots: torch.Tensor,  # [R] int32: each batch row's slot
    computed: torch.Tensor,  # [R] int32: tokens computed before this step
    counts: torch.Tensor,  # [R] int32: tokens computed in this step
    starts: torch.Tensor,  # [R] int32: where each row's tokens start in the batch
    num_tokens: int,
    max_count: int,
    block_size: int,
    num_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [T] int64, positions [T] int64, slot_mapping [G, T] int64)."""
    device = tokens.device
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    slot_mapping = torch.empty((num_groups, num_tokens), dtype=torch.int64, device=device)
    rows = slots.shape[0]
    if rows == 0 or num_tokens == 0:
        return input_ids, positions, slot_mapping
    check_device(device)
    grid = (rows, -(-max_count // TOKENS_PER_PROGRAM))
    _prepare_inputs[grid](
        tokens,
        tables,
        slots,
        computed,
        counts,
        starts,
        input_ids,
        positions,
        slot_mapping,
        tokens.stride(0),
        tables.stride(0),
        block_size,
        num_groups,
        num_tokens,
        BLOCK=TOKENS_PER_PROGRAM,
    )
    return input_ids, positions, slot_mapping
