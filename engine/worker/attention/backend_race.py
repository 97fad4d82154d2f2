"""`auto` on CUDA with two kernel sets that can run: the faster one on a decode step of
the model's own attention shape, timed at start-up (a few milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec

RACE_SEQS, RACE_CONTEXT, RACE_REPEATS = 64, 1024, 10


@dataclass(frozen=True)
class AttentionShape:
    """The attention shape a model's layers run: query heads, KV heads, head size."""

    num_heads: int
    num_kv_heads: int
    head_size: int


def decode_ms(
    backend: AttentionBackend, shape: AttentionShape, block_size: int, dtype: torch.dtype
) -> float:
    """Milliseconds `backend` takes to attend one decode step of RACE_SEQS sequences
    of RACE_CONTEXT tokens (random K/V, distinct blocks), after one warm-up call."""
    device = torch.device("cuda")
    blocks_per_seq = -(-RACE_CONTEXT // block_size)
    cache_shape = backend.kv_cache_shape(
        RACE_SEQS * blocks_per_seq, block_size, shape.num_kv_heads, shape.head_size
    )
    key_cache = torch.randn(cache_shape, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, device=device).to(dtype)
    query = torch.randn(RACE_SEQS, shape.num_heads, shape.head_size, device=device).to(dtype)
    tables = torch.arange(RACE_SEQS * blocks_per_seq, device=device).view(RACE_SEQS, -1)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(RACE_SEQS + 1, device=device),
        seq_lens=torch.full((RACE_SEQS,), RACE_CONTEXT, device=device),
        block_tables=tables,
        slot_mapping=torch.zeros(RACE_SEQS, dtype=torch.int64, device=device),
        query_lens_cpu=(1,) * RACE_SEQS,
        seq_lens_cpu=(RACE_CONTEXT,) * RACE_SEQS,
        num_decodes=RACE_SEQS,
        block_size=block_size,
    )
    spec = AttentionSpec(scale=shape.head_size**-0.5)
    backend.attend(query, key_cache, value_cache, metadata, spec)  # compiles, warms up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(RACE_REPEATS):
        backend.attend(query, key_cache, value_cache, metadata, spec)
    end.record()
    torch.cuda.synchronize()
    elapsed = start.elapsed_time(end) / RACE_REPEATS
    del key_cache, value_cache, query, tables
    torch.cuda.empty_cache()  # the race's buffers must not linger in the KV sizing
    return elapsed
