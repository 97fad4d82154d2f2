"""Launching the workers of N data-parallel replicas, each on GPUs of its own.

Cheap to import (no torch at import time), like `actors.worker_launch`: a server
launches its replicas' workers first thing. On CUDA, replica r's worker sees only its
own GPUs through CUDA_VISIBLE_DEVICES (the r-th slice of the GPUs this process sees,
`gpus_per_replica` each), so every replica's worker runs on its "cuda:0" and sizes its
KV cache against a GPU no other replica uses; too few GPUs is refused before anything
is launched. On CPU the replicas split the cores: each worker process gets an equal share
of threads (OMP_NUM_THREADS, unless the user set it), since N workers each spinning up
a thread per core would fight over every core (on 2 cores, 2 replicas ran at 40% of
their split-core throughput, and varied 2x run to run; bench/scaling_dp.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from actors.worker_launch import WorkerLaunch

if TYPE_CHECKING:
    from engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)
MAX_REPLICAS = 16


def check_num_replicas(num_replicas: int) -> int:
    """`num_replicas` when it is in [1, MAX_REPLICAS]; ValueError naming the flag if not."""
    if isinstance(num_replicas, bool) or not 1 <= num_replicas <= MAX_REPLICAS:
        raise ValueError(
            f"data_parallel_size (--data-parallel-size) must be in [1, {MAX_REPLICAS}], "
            f"got {num_replicas}"
        )
    return num_replicas


def replica_gpus(num_replicas: int, gpus_per_replica: int, visible: Sequence[str]) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES: consecutive slices of `visible` (the GPU ids
    this process sees); ValueError saying what is missing when there are too few."""
    needed = num_replicas * gpus_per_replica
    if len(visible) < needed:
        raise ValueError(
            f"--data-parallel-size {num_replicas} with {gpus_per_replica} GPU(s) per replica "
            f"needs {needed} GPUs, one set per replica; this machine shows {len(visible)} "
            "(CUDA_VISIBLE_DEVICES). Lower --data-parallel-size, or run on CPU"
        )
    per = gpus_per_replica
    return [",".join(visible[r * per : (r + 1) * per]) for r in range(num_replicas)]


def cpu_thread_share(num_processes: int, environ: Mapping[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS for one of `num_processes` worker processes sharing this process's
    cores evenly (at least 1); nothing when the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0))
    return {"OMP_NUM_THREADS": str(max(1, cores // num_processes))}


def replica_envs(
    num_replicas: int, device: str, gpus_per_replica: int, environ: Mapping[str, str]
) -> list[dict[str, str]]:
    """The extra environment of each replica's worker on `device` (the engine config's
    resolved device: "cpu", "cuda")."""
    if not device.startswith("cuda"):
        share = cpu_thread_share(num_replicas * gpus_per_replica, environ)
        return [dict(share) for _ in range(num_replicas)]
    if device != "cuda":
        raise ValueError(
            f"device {device!r} names one GPU; with --data-parallel-size each replica "
            "gets GPUs of its own: use device 'cuda' and CUDA_VISIBLE_DEVICES"
        )
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        visible = [g.strip() for g in listed.split(",") if g.strip()]
    else:
        import torch  # the caller built the engine config: torch is loaded already

        visible = [str(i) for i in range(torch.cuda.device_count())]
    gpus = replica_gpus(num_replicas, gpus_per_replica, visible)
    return [{"CUDA_VISIBLE_DEVICES": g} for g in gpus]


def launch_replicas(args: EngineArgs, num_replicas: int, device: str) -> list[WorkerLaunch]:
    """One worker launch per replica (see the module doc); if one cannot be launched,
    the ones launched already are abandoned."""
    check_num_replicas(num_replicas)
    per_replica = getattr(args, "world_size", 1)  # the GPUs one replica spans
    envs = replica_envs(num_replicas, device, per_replica, os.environ)
    launches: list[WorkerLaunch] = []
    try:
        for replica, env in enumerate(envs):
            launches.append(WorkerLaunch.start(args, extra_env=env))
            gpus = env.get("CUDA_VISIBLE_DEVICES")
            where = f" on GPU {gpus}" if gpus else f", {env.get('OMP_NUM_THREADS', 'all')} threads"
            logger.info("replica %d: worker pid %d%s", replica, launches[-1].process.pid, where)
    except BaseException:
        for launch in launches:
            launch.abandon()
        raise
    return launches
