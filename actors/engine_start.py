"""Start-up of one engine: its worker's ready message raced against this process's config
and tokenizer.

While the worker loads the model and sizes its KV cache, this process builds the config
(config.json only; the worker holds the weights), loads the tokenizer and checks that
its chat template renders, on a thread: none of it needs the worker's `WorkerReady`. A
failure of either fails the start at once: a worker that exits is noticed when it does,
not after the ready timeout; and when this process's step fails too, its error is the
one raised (a config that cannot load says why better than the worker's exit code).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import zmq.asyncio

from actors.actor import ActorStartupError, await_ready
from actors.engine_graph import EngineGraph, TokenizerWiring
from actors.template_renderer import IsolatedRenderer, isolate_templates
from actors.transport import Inbox, Outbox, zmq_inbox, zmq_outbox
from actors.worker_launch import WorkerLaunch, kill_processes
from actors.worker_monitor import WorkerMonitor
from engine.codec import InboxDecoder
from engine.config import EngineConfig
from engine.engine_args import EngineArgs
from engine.messages import INBOXES, WorkerReady
from engine.text.tokenizer import Tokenizer
from engine.wiring import build_engine, load_engine_tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class StartUp:
    """What a successful `start_up` hands the engine, which owns it from then on: the
    `launch` (its workers), the ZeroMQ `ctx`, the scheduler's bound inbox (the ready
    message read from it), one `WorkerMonitor` per rank (those on other hosts too), rank
    0's `ready`, this process's `config`, `tokenizer` and chat-template `renderer`, and
    the plan inbox address of each rank on another host (`remote_plans`, by rank).

    `build_graph()` wires the engine's actors to them (once); `release(timeout)`, once
    every socket on `ctx` is closed (the actors stopped), frees the rest; idempotent."""

    launch: WorkerLaunch
    ctx: zmq.asyncio.Context
    scheduler_inbox: Inbox
    monitors: tuple[WorkerMonitor, ...]
    ready: WorkerReady
    config: EngineConfig
    tokenizer: Tokenizer | None
    renderer: IsolatedRenderer | None
    remote_plans: dict[int, str]

    def build_graph(self, pipeline_depth: int, clients: dict[str, Outbox]) -> EngineGraph:
        """The engine's actors (`build_engine`'s parts) on these workers: the scheduler on
        the bound inbox, its plans to every rank; the tokenizer's requests to the
        scheduler over ipc, its outputs to `clients`."""
        parts = build_engine(
            self.config, self.ready, with_block_manager=True, tokenizer=self.tokenizer
        )
        to_scheduler = zmq_outbox(self.ctx, self.launch.scheduler_address)
        tokenizer = TokenizerWiring(parts.processor, to_scheduler, clients)
        to_workers = self._worker_outboxes()
        return EngineGraph(
            parts.core,
            parts.block_manager,
            self.scheduler_inbox,
            to_workers,
            pipeline_depth,
            tokenizer,
        )

    def _worker_outboxes(self) -> list[Outbox]:
        """One plan outbox per rank: this host's over ipc, the others' sealed over tcp."""
        outboxes = [zmq_outbox(self.ctx, a) for a in self.launch.worker_addresses]
        for rank, address in self.remote_plans.items():
            auth = self.launch.head.plan_auth(rank)
            outboxes.append(zmq_outbox(self.ctx, address, auth))
        return outboxes

    async def release(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for the workers to exit and kills the rest;
        closes the renderer, the monitors and `ctx`; removes the run directory; stops the
        head (its store stops: remote ranks still up exit)."""
        if self.ctx.closed:
            return
        await asyncio.to_thread(_wait_or_kill, self.launch.processes, timeout)
        if self.renderer is not None:
            self.renderer.close()
        for monitor in self.monitors:
            monitor.close()
        self.ctx.term()
        shutil.rmtree(self.launch.run_dir, ignore_errors=True)
        if self.launch.head is not None:
            self.launch.head.close()


@dataclass(frozen=True)
class _Prepared:
    """This process's half of the start-up."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    renderer: IsolatedRenderer | None

    def close(self) -> None:
        if self.renderer is not None:
            self.renderer.close()


async def start_up(
    args: EngineArgs, config: EngineConfig | None, launch: WorkerLaunch, timeout: float
) -> StartUp:
    """Adopts `launch` (workers launched for `args`) and races its ready message, within
    `timeout` seconds, against this process's config (`config`, or `args.build()`) and
    tokenizer (see the module doc). On any failure, or the caller's cancellation, nothing
    is left behind: the launch is abandoned, every socket and the renderer closed."""
    ctx = zmq.asyncio.Context()
    inbox, monitors, prepared = None, [], None
    try:
        if launch.args != args:
            raise ValueError("the worker was launched for other engine arguments")
        inbox = zmq_inbox(ctx, launch.scheduler_address)
        for process, address in zip(launch.processes, launch.heartbeat_addresses, strict=True):
            monitors.append(WorkerMonitor(process, address))
        if launch.head is not None:  # ranks on other hosts: their heartbeats
            monitors.extend(launch.head.monitors)
        ready, prepared = await _race(args, config, launch, inbox, timeout)
        remote = launch.head.plan_addresses() if launch.head is not None else {}
    except BaseException:
        launch.abandon()
        if prepared is not None:
            prepared.close()
        for closable in (*monitors, inbox):
            if closable is not None:
                closable.close()
        ctx.term()
        raise
    return StartUp(
        launch=launch,
        ctx=ctx,
        scheduler_inbox=inbox,
        monitors=tuple(monitors),
        ready=ready,
        config=prepared.config,
        tokenizer=prepared.tokenizer,
        renderer=prepared.renderer,
        remote_plans=remote,
    )


async def _race(
    args: EngineArgs, config: EngineConfig | None, launch: WorkerLaunch, inbox, timeout: float
) -> tuple[WorkerReady, _Prepared]:
    """The worker's ready message and this process's half, or the first failure (this
    process's, when both fail)."""

    def prepare() -> _Prepared:
        built = config or args.build()
        tokenizer = load_engine_tokenizer(built)
        return _Prepared(built, tokenizer, isolate_templates(tokenizer))

    started = launch.launched_at
    ready = asyncio.ensure_future(_since(started, _worker_ready(launch, inbox, timeout)))
    prepared = asyncio.ensure_future(_since(started, asyncio.to_thread(prepare)))
    try:
        await asyncio.wait({ready, prepared}, return_when=asyncio.FIRST_EXCEPTION)
        if ready.done() and ready.exception() is not None:
            await asyncio.wait({prepared})
        parent, parent_s = await prepared
        try:
            worker, worker_s = await ready
        except BaseException:
            parent.close()
            raise
    finally:
        ready.cancel()
        prepared.cancel()
    logger.info(
        "worker 0 ready %.2f s after its launch; config and tokenizer here after %.2f s",
        worker_s,
        parent_s,
    )
    return worker, parent


async def _since(launched_at: float, step: Awaitable[T]) -> tuple[T, float]:
    """`step`'s result, and the seconds from the workers' launch until it came."""
    result = await step
    return result, time.monotonic() - launched_at


async def _worker_ready(launch: WorkerLaunch, inbox, timeout: float) -> WorkerReady:
    """The worker's ready message, or an error as soon as a rank's process exits (a
    model that cannot load fails the start at once, not after `timeout`)."""
    waiting = asyncio.ensure_future(
        await_ready(
            inbox, InboxDecoder(INBOXES["scheduler"]), WorkerReady, timeout, sender="worker 0"
        )
    )
    try:
        while not waiting.done():
            for rank, process in enumerate(launch.processes):
                code = process.poll()
                if code is not None:
                    raise ActorStartupError(
                        f"worker {rank} exited with code {code} before it was ready "
                        "(its error is in the log above)"
                    )
            await asyncio.wait({waiting}, timeout=0.1)
        ready, _ = waiting.result()
        return ready
    finally:
        waiting.cancel()


def _wait_or_kill(processes, timeout: float) -> None:
    """Waits up to `timeout` seconds in all for the processes to exit, then kills the rest."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    kill_processes(processes)
