"""Tensor-parallel layers over torch.distributed's gloo backend: two processes on
this machine, each holding half of every weight, compute what one device computes."""

from __future__ import annotations

import multiprocessing

import pytest

from engine.worker.parallel.group import TensorParallelGroup
from tests.engine.tp_ranks import DIM, HIDDEN, run_rank


@pytest.mark.timeout(120)
def test_two_ranks_compute_what_one_device_computes(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [ctx.Process(target=run_rank, args=(r, 2, init, results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        got = dict(results.get(timeout=90) for _ in ranks)
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert set(got) == {0, 1}
    for rank, checks in got.items():
        assert isinstance(checks, dict), f"rank {rank} failed: {checks}"
        assert checks["column_shard_rows"] == HIDDEN // 2  # each rank holds half
        for name in ("mlp", "embedding", "lm_head"):
            assert checks[name] < 1e-4, (rank, name, checks)


def test_one_rank_is_the_plain_layer() -> None:
    import torch

    from tests.engine.tp_ranks import checks

    torch.manual_seed(0)
    w1, w2, b2 = torch.randn(HIDDEN, DIM), torch.randn(DIM, HIDDEN), torch.randn(DIM)
    table, x = torch.randn(11, DIM), torch.randn(3, DIM)
    result = checks(TensorParallelGroup(), w1, w2, b2, table, x, torch.tensor([0, 10]))
    assert result["mlp"] < 1e-5 and result["embedding"] == 0 and result["lm_head"] < 1e-5
    assert result["column_shard_rows"] == HIDDEN


def test_an_uneven_split_names_what_cannot_be_shared() -> None:
    with pytest.raises(ValueError, match=r"attention heads \(9\) does not split evenly"):
        TensorParallelGroup(1, 2).shard(9, "attention heads")
    assert TensorParallelGroup(1, 2).shard(8, "heads") == (4, 8)
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallelGroup(2, 2)
