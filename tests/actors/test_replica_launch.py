"""Where data-parallel replicas' workers run: each on GPUs of its own (pure placement
rules, no GPU needed), and the replica count's range."""

from __future__ import annotations

import os

import pytest

from actors.replica_launch import check_num_replicas, replica_envs, replica_gpus


def test_each_replica_gets_its_own_slice_of_the_visible_gpus():
    assert replica_gpus(2, 1, ["0", "1", "2"]) == ["0", "1"]
    assert replica_gpus(2, 2, ["4", "5", "6", "7"]) == ["4,5", "6,7"]
    envs = replica_envs(2, "cuda", 1, {"CUDA_VISIBLE_DEVICES": "3, 5"})
    assert envs == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]


def test_cpu_replicas_split_the_cores():
    cores = len(os.sched_getaffinity(0))
    envs = replica_envs(2, "cpu", 1, {"CUDA_VISIBLE_DEVICES": "0"})
    assert envs == [{"OMP_NUM_THREADS": str(max(1, cores // 2))}] * 2
    two_ranks_each = replica_envs(2, "cpu", 2, {})
    assert two_ranks_each == [{"OMP_NUM_THREADS": str(max(1, cores // 4))}] * 2
    assert replica_envs(3, "cpu", 1, {"OMP_NUM_THREADS": "3"}) == [{}, {}, {}]  # the user's


def test_too_few_gpus_or_one_named_gpu_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="needs 4 GPUs.*shows 3"):
        replica_gpus(2, 2, ["0", "1", "2"])
    with pytest.raises(ValueError, match="needs 2 GPUs.*shows 1"):
        replica_envs(2, "cuda", 1, {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="'cuda:1' names one GPU"):
        replica_envs(2, "cuda:1", 1, {})


@pytest.mark.parametrize("bad", [0, -1, 17, True])
def test_the_replica_count_must_be_in_range(bad):
    with pytest.raises(ValueError, match=r"--data-parallel-size\) must be in \[1, 16\]"):
        check_num_replicas(bad)
    assert check_num_replicas(16) == 16
