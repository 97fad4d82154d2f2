"""The worker actor: one process per device, holding the model and its KV cache.

Start-up: build the model runner, size and allocate the KV cache, then announce the
values found (number of blocks, ...) in a `WorkerReady` message. After that each
`StepPlan` is executed and answered with a `StepResult`. Requests the worker could not
run are named in `StepResult.failed` (the Worker's failure rule); an exception that
cannot be tied to requests ends the actor, and the process exits with status 1.

Liveness: a `Heartbeat` thread sends a `WorkerHeartbeat` every interval on a socket of
its own, whatever the main thread is doing, so the engine tells a frozen or dead worker
(silence) from one running a long step (heartbeats go on).

Run as a process (`actors.worker_launch` spawns it): `python -m actors.worker_actor
--engine-args JSON --inbox ADDR --scheduler ADDR [--heartbeat ADDR] [--worker-id N]
[--rank R] [--null-worker]` (JSON of `EngineArgs` fields; no pickle). Each StepResult carries the
seconds the step took to execute (`busy_seconds`). Start-up logs a line as each phase
ends (imports done, engine config built, ready; bench/startup.py times them).

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
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from actors.actor import Actor, send_message
from actors.frame_auth import FrameAuth
from actors.transport import Inbox, Outbox, zmq_inbox, zmq_outbox
from engine.codec import encode
from engine.engine_args import EngineArgs
from engine.messages import StepPlan, WorkerHeartbeat, WorkerReady
from engine.worker.kv_transfer_steps import KVTransferSteps
from engine.worker.worker import Worker, build_null_worker, build_worker

logger = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 0.5


class RankDiverged(RuntimeError):
    """A tensor-parallel rank other than 0 could not run requests of a step: its cache
    and rank 0's would drift apart, so it stops (the engine then takes the group down)."""


class WorkerActor(Actor):
    """Executes StepPlans on one Worker and reports each step's sampled tokens.

    Under tensor parallelism every rank executes every plan, and only rank 0 answers
    (`answers`): its results are the group's. Another rank that fails requests of a step
    crashes (`RankDiverged`) instead of running on with a cache unlike rank 0's."""

    def __init__(
        self, worker: Worker, inbox: Inbox, scheduler: Outbox | None, answers: bool = True
    ) -> None:
        outboxes = [] if scheduler is None else [scheduler]
        super().__init__(f"worker-{worker.worker_id}", inbox, {StepPlan: self.on_plan}, outboxes)
        self.worker = worker
        self.scheduler = scheduler
        self.answers = answers and scheduler is not None

    async def on_plan(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        result = self.worker.execute(plan)
        busy = time.perf_counter() - start
        if self.answers:
            await send_message(self.scheduler, dataclasses.replace(result, busy_seconds=busy))
        elif result.failed:
            failed = result.failed[0]
            raise RankDiverged(f"step {plan.step_id}: {failed.request_id}: {failed.error}")


class Heartbeat:
    """A daemon thread that sends worker `worker_id`'s WorkerHeartbeat to `address`
    every `interval` seconds over a ZeroMQ socket of its own (sockets are not
    thread-safe), until `stop()`; with `auth`, each one sealed under a sender nonce of
    its own."""

    def __init__(
        self, worker_id: int, address: str, interval: float, auth: FrameAuth | None = None
    ) -> None:
        self.worker_id, self.address, self.interval = worker_id, address, interval
        self.expert_load: Callable[[], tuple[int, ...]] = tuple  # set once the model is up
        self._auth = None if auth is None else auth.for_channel(auth.channel)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stopped.is_set():
                beat = WorkerHeartbeat(self.worker_id, time.monotonic(), self.expert_load())
                frame = encode(beat)
                sock.send(frame if self._auth is None else self._auth.seal(frame))
                self._stopped.wait(self.interval)
        finally:
            sock.close(linger=0)
            ctx.term()


async def serve(
    args: EngineArgs,
    inbox_address: str,
    scheduler_address: str,
    worker_id: int,
    null_worker: bool = False,
    heartbeat_address: str | None = None,
    rank: int = 0,
) -> bool:
    """Runs the worker (tensor-parallel rank `rank`) until Shutdown or its engine is
    gone; False if its actor crashed."""
    ctx = zmq.asyncio.Context()
    scheduler = zmq_outbox(ctx, scheduler_address)
    inbox = zmq_inbox(ctx, inbox_address)
    heartbeat = None
    if heartbeat_address is not None:
        heartbeat = Heartbeat(worker_id, heartbeat_address, HEARTBEAT_INTERVAL_S)
    try:
        gone = _parent_gone(os.getppid())
        return await run_worker(
            args, inbox, scheduler, heartbeat, worker_id, rank, gone, null_worker
        )
    finally:
        inbox.close()
        scheduler.close()
        ctx.term()


async def run_worker(
    args: EngineArgs,
    inbox: Inbox,
    scheduler: Outbox | None,
    heartbeat: Heartbeat | None,
    worker_id: int,
    rank: int,
    gone: Callable[[], Awaitable[str | None]],
    null_worker: bool = False,
) -> bool:
    """Builds the worker, then runs it on these channels (`scheduler` None: a rank that
    never answers) until Shutdown, or until `gone()` names a reason to stop (asked
    every half second: nobody left to serve); False if its actor crashed or it was
    left. Starts `heartbeat` once the model is built, and stops it."""
    try:
        worker, ready = _build(args, worker_id, null_worker, rank)
        actor = WorkerActor(worker, inbox, scheduler, answers=rank == 0)
        if heartbeat is not None:
            heartbeat.expert_load = worker.expert_load
            heartbeat.start()
        if rank == 0:  # ready once every rank is: the ranks agreed on the block count
            await send_message(scheduler, ready)
        reason = await _run_until_gone(actor.run(), gone)
        if rank > 0 and worker.runner is not None:
            worker.runner.group.leave()
        return actor.crash is None and reason is None
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _build(
    args: EngineArgs, worker_id: int, null_worker: bool, rank: int
) -> tuple[Worker, WorkerReady]:
    """The worker and its ready message, each start-up phase logged as it ends."""
    if null_worker:
        return build_null_worker(args, worker_id)
    config = args.build()
    logger.info("engine config built")
    worker, ready = build_worker(args, worker_id, config, rank)
    logger.info("ready: %d KV cache blocks of %d tokens", ready.num_blocks, ready.block_size)
    if config.kv_transfer is not None:
        worker.kv_transfer = kv_transfer_steps(worker, config)
    return worker, ready


def kv_transfer_steps(worker: Worker, config) -> KVTransferSteps:
    """The worker's KV transfer over ZeroMQ (its role from `config.kv_transfer`), frames
    sealed with the cluster secret ($PAGEDSERVE_CLUSTER_SECRET)."""
    from actors.cluster_secret import load_cluster_secret
    from actors.kv_transfer_connector import ZmqConnector
    from engine.kv_transfer.blocks import KVLayout
    from engine.kv_transfer.endpoint import KVEndpoint

    runner = worker.runner
    layout = KVLayout.of(runner.backend.kv_cache_shape)
    endpoint = KVEndpoint(config.kv_transfer, runner.kv_cache, layout)
    connector = ZmqConnector(endpoint, load_cluster_secret(None))
    logger.info("KV transfer: %s", config.kv_transfer.kv_role.value)
    return KVTransferSteps(connector, config.cache.block_size)


def _parent_gone(parent: int) -> Callable[[], Awaitable[str | None]]:
    """Gone once the engine process `parent` is (this process was re-parented: an
    orphan has nobody to serve)."""

    async def gone() -> str | None:
        if os.getppid() != parent:
            return f"engine process {parent} is gone"
        return None

    return gone


async def _run_until_gone(
    run, gone: Callable[[], Awaitable[str | None]], interval: float = 0.5
) -> str | None:
    """Runs the actor until it stops, or until `gone()` gives a reason to stop (returned)."""
    actor = asyncio.ensure_future(run)
    reason = None
    while not actor.done():
        await asyncio.wait({actor}, timeout=interval)
        reason = None if actor.done() else await gone()
        if reason is not None:
            logger.error("%s; the worker exits", reason)
            actor.cancel()
            break
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await actor  # a crash is the actor's to report (Actor.crash)
    return reason


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-worker")
    p.add_argument("--engine-args", required=True, help="JSON of EngineArgs fields")
    p.add_argument("--inbox", required=True)
    p.add_argument("--scheduler", required=True)
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    p.add_argument("--heartbeat", default=None, help="address for liveness heartbeats")
    p.add_argument(
        "--null-worker", action="store_true", help="no model: sample a fixed token (benchmarks)"
    )
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"worker-{ns.worker_id} %(levelname)s %(message)s"
    )
    logger.info("started (pid %d), imports done", os.getpid())
    args = EngineArgs(**json.loads(ns.engine_args))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process stops us
    ok = asyncio.run(
        serve(args, ns.inbox, ns.scheduler, ns.worker_id, ns.null_worker, ns.heartbeat, ns.rank)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
