"""What each rank of tests/engine/test_tensor_parallel_layers.py runs (a module of its
own so that spawned processes can import it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
)

VOCAB, DIM, HIDDEN = 11, 16, 32  # an odd vocabulary: the last rank's slice is padded


def run_rank(rank: int, world_size: int, init_method: str, results) -> None:
    """Puts (rank, {check: max abs difference from the one-device result}) on `results`."""
    try:
        group = TensorParallelGroup.initialize(rank, world_size, init_method, "gloo")
        torch.manual_seed(0)  # every rank draws the same full weights and inputs
        w1, w2, b2 = torch.randn(HIDDEN, DIM), torch.randn(DIM, HIDDEN), torch.randn(DIM)
        table, x = torch.randn(VOCAB, DIM), torch.randn(5, DIM)
        ids = torch.tensor([0, 3, 5, 6, 10, 7])
        results.put((rank, checks(group, w1, w2, b2, table, x, ids)))
    except Exception as exc:  # noqa: BLE001 - reported to the test, not lost in a child
        results.put((rank, repr(exc)))


def checks(group, w1, w2, b2, table, x, ids) -> dict[str, float]:
    up = ColumnParallelLinear(DIM, (Part.even(HIDDEN, group, "hidden"),), False, group)
    down = RowParallelLinear(HIDDEN, DIM, True, group)
    up.load("weight", w1, None)
    down.load("weight", w2)
    down.load("bias", b2)
    embed = VocabParallelEmbedding(VOCAB, DIM, group)
    embed.load("weight", table)
    head = ParallelLMHead(VOCAB, DIM, group)
    head.load("weight", table)
    with torch.no_grad():
        mlp = down(F.silu(up(x)))
        expected_mlp = F.linear(F.silu(F.linear(x, w1)), w2) + b2
        return {
            "mlp": (mlp - expected_mlp).abs().max().item(),
            "embedding": (embed(ids) - table[ids]).abs().max().item(),
            "lm_head": (head(x) - x @ table.T).abs().max().item(),
            "column_shard_rows": float(up.weight.shape[0]),
        }
