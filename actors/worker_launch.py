"""Launching a worker process: the process, its run directory and its addresses.

Cheap to import (no torch, no model code), so that a server can launch its worker first
thing and let the model load while the server itself is still importing and starting:
`WorkerLaunch.start(args)` spawns `python -m actors.worker_actor`, and
`AsyncEngine.start(args, launch=launch)` later binds the sockets the worker sends to and
adopts it. The worker may connect before they are bound: ZeroMQ queues what it sends
(its ready message) and connects once they are (see `actors.transport`). A launch that
is never adopted must be `abandon()`ed: its process is killed, its run directory removed
(idempotent, and harmless after the engine's own shutdown: a caller may always call it
last). A failed `AsyncEngine.start` abandons the launch it was given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.cluster_secret import load_cluster_secret, secret_environment
from actors.transport import ipc_address, new_run_dir
from engine.child_process import start_module

if TYPE_CHECKING:
    from actors.head import Head
    from engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)


def engine_args_json(args: EngineArgs) -> str:
    return json.dumps(dataclasses.asdict(args))


def spawn_worker(
    args: EngineArgs,
    inbox: str,
    scheduler: str,
    worker_id: int = 0,
    extra_env: dict[str, str] | None = None,
    null_worker: bool = False,
    heartbeat: str | None = None,
    rank: int = 0,
) -> subprocess.Popen:
    """Starts `python -m actors.worker_actor` with this repository importable
    (`null_worker`: a NullWorker, no model, for control-plane benchmarks; `heartbeat`:
    where its heartbeats go, none when None; `rank`: its tensor-parallel rank)."""
    cmd = worker_arguments(args, inbox, scheduler, worker_id, null_worker, heartbeat, rank)
    return start_module("actors.worker_actor", cmd, extra_env)


def worker_arguments(
    args: EngineArgs,
    inbox: str,
    scheduler: str,
    worker_id: int = 0,
    null_worker: bool = False,
    heartbeat: str | None = None,
    rank: int = 0,
) -> list[str]:
    """`actors.worker_actor`'s command-line arguments (see `spawn_worker`)."""
    return [
        "--engine-args",
        engine_args_json(args),
        "--inbox",
        inbox,
        "--scheduler",
        scheduler,
        "--worker-id",
        str(worker_id),
        "--rank",
        str(rank),
        *(["--null-worker"] if null_worker else []),
        *(["--heartbeat", heartbeat] if heartbeat else []),
    ]


@dataclass(frozen=True)
class WorkerLaunch:
    """The workers of an engine, launched for `args`: one process per tensor-parallel
    rank, and the private run directory holding the ipc addresses each receives on
    (`worker_addresses`) and sends to (`scheduler_address`, `heartbeat_addresses`) and
    the ranks' torch.distributed rendezvous (a file there). `launched_at` is
    `time.monotonic()`. `process`, `worker_address`, `heartbeat_address`: rank 0's.

    With ranks on other hosts, `processes` and the addresses are this host's ranks', and
    `head` serves the others (`actors.head`): their store, heartbeats and plan inboxes;
    `remote_processes` are those Ray started on other nodes (killed with the launch)."""

    args: EngineArgs
    processes: tuple[subprocess.Popen, ...]
    run_dir: str
    worker_addresses: tuple[str, ...]
    scheduler_address: str
    heartbeat_addresses: tuple[str, ...]
    launched_at: float
    head: Head | None = None
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    remote_processes: tuple = ()

    @property
    def process(self) -> subprocess.Popen:
        return self.processes[0]

    @property
    def worker_address(self) -> str:
        return self.worker_addresses[0]

    @property
    def heartbeat_address(self) -> str:
        return self.heartbeat_addresses[0]

    @property
    def world_size(self) -> int:
        return self.args.world_size

    @classmethod
    def start(
        cls,
        args: EngineArgs,
        extra_env: dict[str, str] | None = None,
        local_ranks: int | None = None,
        secret: bytes | None = None,
    ) -> WorkerLaunch:
        """`extra_env`: set in the worker's environment (a replica's CUDA_VISIBLE_DEVICES).
        `local_ranks`: how many ranks run here (default: all); the others join from
        other hosts, and need `args.distributed_address` and the cluster `secret`."""
        head, placement = None, None
        local_ranks = args.world_size if local_ranks is None else local_ranks
        if args.distributed_executor_backend == "ray":
            placement = _reserve_on_ray(args)
            if placement.remote_bundles:  # Ray put ranks on other nodes: they join a head
                local_ranks = len(placement.local_bundles)
                secret = secret or load_cluster_secret(None)
        if local_ranks != args.world_size:
            from actors import head as heads  # torch.distributed: only for remote ranks

            head = heads.Head.start(args, local_ranks, secret)
        run_dir = new_run_dir()
        processes: list[subprocess.Popen] = []
        remote: list = []
        try:
            ranks = range(local_ranks)
            workers = tuple(ipc_address(run_dir, f"worker-{r}") for r in ranks)
            beats = tuple(ipc_address(run_dir, f"heartbeat-{r}") for r in ranks)
            scheduler = ipc_address(run_dir, "scheduler")
            rank_args = head.local_args if head else _with_rendezvous(args, run_dir)
            env = {**(extra_env or {}), **(head.local_environment() if head else {})}
            if placement is not None:
                processes += _place_on_ray(placement, rank_args, workers, scheduler, beats, env)
                remote += _join_from_ray(placement, args, secret, extra_env or {})
            else:
                for r in ranks:
                    worker = spawn_worker(
                        rank_args, workers[r], scheduler, r, env, heartbeat=beats[r], rank=r
                    )
                    processes.append(worker)
        except BaseException:
            kill_processes([*processes, *remote])
            shutil.rmtree(run_dir, ignore_errors=True)
            if head is not None:
                head.close()
            raise
        logger.info(
            "spawned %d worker process(es): pids %s", len(processes), [p.pid for p in processes]
        )
        launched = time.monotonic()
        return cls(
            args,
            tuple(processes),
            run_dir,
            workers,
            scheduler,
            beats,
            launched,
            head,
            dict(extra_env or {}),
            tuple(remote),
        )

    @property
    def can_relaunch(self) -> bool:
        """Whether `relaunch` can start these workers again: every rank runs here."""
        return self.head is None

    def relaunch(self) -> WorkerLaunch:
        """A fresh launch of the same workers (same arguments and environment), for an
        engine that replaces a dead one. Only where `can_relaunch`."""
        if not self.can_relaunch:
            raise ValueError("workers with ranks on other hosts cannot be relaunched from here")
        return WorkerLaunch.start(self.args, extra_env=self.extra_env)

    def abandon(self) -> None:
        """Kills the processes (those still running), removes the run directory and
        stops the head (remote ranks then exit); idempotent."""
        kill_processes([*self.processes, *self.remote_processes])
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.head is not None:
            self.head.close()


def _reserve_on_ray(args: EngineArgs):
    """A Ray placement group of one bundle per rank (actors/ray_placement.py)."""
    from actors.ray_placement import reserve_bundles

    return reserve_bundles(args.world_size, on_gpu=(args.device or "").startswith("cuda"))


def _place_on_ray(placement, args: EngineArgs, workers, scheduler: str, beats, env) -> list:
    """The ranks of this node's bundles: their workers, as the default launch runs them."""
    from actors.ray_placement import start_ranks

    commands = [
        ["actors.worker_actor", *worker_arguments(args, w, scheduler, r, heartbeat=b, rank=r)]
        for r, (w, b) in enumerate(zip(workers, beats, strict=True))
    ]
    return start_ranks(placement, placement.local_bundles, commands, env)


def _join_from_ray(placement, args: EngineArgs, secret: bytes | None, env) -> list:
    """The ranks Ray put on other nodes: `pagedserve worker --head`, joining this
    launch's head over tcp with the cluster secret (in their environment; not this
    host's rank environment, whose network interface is this host's)."""
    if not placement.remote_bundles:
        return []
    from actors.ray_placement import start_ranks

    first = len(placement.local_bundles)
    head = f"tcp://{args.distributed_address}"
    commands = [
        ["web.cli", "worker", "--head", head, "--rank", str(first + i)]
        for i in range(len(placement.remote_bundles))
    ]
    remote_env = {**env, **secret_environment(secret)}
    return start_ranks(placement, placement.remote_bundles, commands, remote_env)


def _with_rendezvous(args: EngineArgs, run_dir: str) -> EngineArgs:
    """Ranks on this host meet at a file in the run directory, unless the user named a
    torch.distributed address."""
    if args.world_size == 1 or args.distributed_address or args.distributed_init_method:
        return args
    init = f"file://{os.path.join(run_dir, 'rendezvous')}"
    return dataclasses.replace(args, distributed_init_method=init)


def kill_processes(processes) -> None:
    """Kills those still running and reaps them all."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()
