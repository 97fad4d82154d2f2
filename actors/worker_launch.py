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
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.transport import ipc_address, new_run_dir

if TYPE_CHECKING:
    from engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
) -> subprocess.Popen:
    """Starts `python -m actors.worker_actor` with this repository importable
    (`null_worker`: a NullWorker, no model, for control-plane benchmarks; `heartbeat`:
    where its heartbeats go, none when None)."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **(extra_env or {}))
    cmd = [
        sys.executable,
        "-m",
        "actors.worker_actor",
        "--engine-args",
        engine_args_json(args),
        "--inbox",
        inbox,
        "--scheduler",
        scheduler,
        "--worker-id",
        str(worker_id),
        *(["--null-worker"] if null_worker else []),
        *(["--heartbeat", heartbeat] if heartbeat else []),
    ]
    return subprocess.Popen(cmd, env=env)


@dataclass(frozen=True)
class WorkerLaunch:
    """Worker 0 of an engine, launched for `args`: its process, and the private run
    directory holding the ipc addresses it receives on (`worker_address`) and sends to
    (`scheduler_address`, `heartbeat_address`). `launched_at` is `time.monotonic()`."""

    args: EngineArgs
    process: subprocess.Popen
    run_dir: str
    worker_address: str
    scheduler_address: str
    heartbeat_address: str
    launched_at: float

    @classmethod
    def start(cls, args: EngineArgs) -> WorkerLaunch:
        run_dir = new_run_dir()
        try:
            names = ("worker-0", "scheduler", "heartbeat-0")
            worker, scheduler, heartbeat = (ipc_address(run_dir, name) for name in names)
            process = spawn_worker(args, worker, scheduler, heartbeat=heartbeat)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        logger.info("spawned worker 0 (pid %d)", process.pid)
        return cls(args, process, run_dir, worker, scheduler, heartbeat, time.monotonic())

    def abandon(self) -> None:
        """Kills the process (if it still runs) and removes the run directory; idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
