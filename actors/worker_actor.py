"""The worker actor: one process per device, holding the model and its KV cache.

Start-up: build the model runner, size and allocate the KV cache, then announce the
values found (number of blocks, ...) in a `WorkerReady` message. After that each
`StepPlan` is executed and answered with a `StepResult`; a step that raises is answered
with `StepResult.error` set instead of killing the process.

Run as a process: `python -m actors.worker_actor --engine-args JSON --inbox ADDR
--scheduler ADDR [--worker-id N] [--null-worker]` (JSON of `EngineArgs` fields; no
pickle). Each StepResult carries the seconds the step took to execute (`busy_seconds`).

The engine process owns the worker's lifetime: the worker ignores SIGINT (a terminal's
Ctrl-C reaches the whole process group; the engine's graceful shutdown stops the worker
with a `Shutdown` message), and exits by itself when the engine process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback

import zmq
import zmq.asyncio

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox, zmq_inbox, zmq_outbox
from engine.config import EngineArgs
from engine.messages import StepPlan, StepResult
from engine.worker import Worker, build_null_worker, build_worker

logger = logging.getLogger(__name__)


class WorkerActor(Actor):
    """Executes StepPlans on one Worker and reports each step's sampled tokens."""

    def __init__(self, worker: Worker, inbox: Inbox, scheduler: Outbox) -> None:
        super().__init__(f"worker-{worker.worker_id}", inbox, {StepPlan: self.on_plan}, [scheduler])
        self.worker = worker
        self.scheduler = scheduler

    async def on_plan(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        try:
            result = self.worker.execute(plan)
        except Exception as exc:  # noqa: BLE001 - the scheduler decides what a failed step means
            logger.exception("step %d failed", plan.step_id)
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            result = StepResult(plan.step_id, self.worker.worker_id, (), detail)
        busy = time.perf_counter() - start
        await send_message(self.scheduler, dataclasses.replace(result, busy_seconds=busy))


def engine_args_json(args: EngineArgs) -> str:
    return json.dumps(dataclasses.asdict(args))


def spawn_worker(
    args: EngineArgs,
    inbox: str,
    scheduler: str,
    worker_id: int = 0,
    extra_env: dict[str, str] | None = None,
    null_worker: bool = False,
) -> subprocess.Popen:
    """Starts `python -m actors.worker_actor` with this repository importable
    (`null_worker`: a NullWorker, no model, for control-plane benchmarks)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
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
    ]
    return subprocess.Popen(cmd, env=env)


async def serve(
    args: EngineArgs,
    inbox_address: str,
    scheduler_address: str,
    worker_id: int,
    null_worker: bool = False,
) -> None:
    ctx = zmq.asyncio.Context()
    scheduler = zmq_outbox(ctx, scheduler_address)
    inbox = zmq_inbox(ctx, inbox_address)
    try:
        build = build_null_worker if null_worker else build_worker
        worker, ready = build(args, worker_id)
        actor = WorkerActor(worker, inbox, scheduler)
        await send_message(scheduler, ready)
        await _run_while_parent_lives(actor.run(), os.getppid())
    finally:
        inbox.close()
        scheduler.close()
        ctx.term()


async def _run_while_parent_lives(run, parent: int, interval: float = 0.5) -> None:
    """Runs the actor until it stops or the engine process `parent` is gone (then this
    process was re-parented: an orphan has nobody to serve)."""
    actor = asyncio.ensure_future(run)
    while not actor.done():
        await asyncio.wait({actor}, timeout=interval)
        if os.getppid() != parent:
            logger.error("engine process %d is gone; the worker exits", parent)
            actor.cancel()
            break
    with contextlib.suppress(asyncio.CancelledError):
        await actor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-worker")
    p.add_argument("--engine-args", required=True, help="JSON of EngineArgs fields")
    p.add_argument("--inbox", required=True)
    p.add_argument("--scheduler", required=True)
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument(
        "--null-worker", action="store_true", help="no model: sample a fixed token (benchmarks)"
    )
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"worker-{ns.worker_id} %(levelname)s %(message)s"
    )
    args = EngineArgs(**json.loads(ns.engine_args))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process stops us
    asyncio.run(serve(args, ns.inbox, ns.scheduler, ns.worker_id, ns.null_worker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
