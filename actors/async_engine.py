"""`AsyncEngine`: the engine client that web handlers and the SDK talk to.

Layout: the tokenizer, scheduler and block manager actors run on the caller's event loop
(the block manager reached through the in-process transport); each worker is its own
process (`python -m actors.worker_actor`), reached over ZeroMQ ipc. The scheduler's inbox
is an ipc socket too, so worker results and requests from the tokenizer arrive through
one typed inbox.

Supervision (`_watch`, a few times a second): a worker process that exits or an actor
that crashed (the failure rule's "cannot be tied to one request") ends every open
request with an error and shuts the engine down. A worker silent past
`Supervision.worker_timeout_s` (frozen, wedged) makes the engine unhealthy and fails
every open request; when its heartbeats come back, the engine is healthy again. A
request older than `Supervision.request_timeout_s` is ended with a timeout error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import zmq
import zmq.asyncio

from actors.actor import ActorStartupError, await_ready, send_message
from actors.block_manager_actor import BlockManagerActor
from actors.engine_status import EngineStatus
from actors.scheduler_actor import SchedulerActor
from actors.template_renderer import IsolatedRenderer, isolate_templates
from actors.tokenizer_actor import TokenizerActor
from actors.transport import inproc_pair, zmq_inbox, zmq_outbox
from actors.worker_launch import WorkerLaunch, kill_processes
from actors.worker_monitor import WorkerMonitor
from engine.codec import DecodeError, InboxDecoder
from engine.config import EngineConfig
from engine.core.stats import EngineStats
from engine.engine_args import EngineArgs
from engine.errors import EngineBusy
from engine.messages import (
    INBOXES,
    AbortRequest,
    DetokenizeRequest,
    ErrorKind,
    GenerateRequest,
    OutputDelta,
    Shutdown,
    TokenizeRequest,
    TokenizeResult,
    WorkerReady,
    chat_of,
)
from engine.sampling_params import SamplingParams
from engine.text.text_checks import check_request_id
from engine.text.tokenizer import Tokenizer
from engine.wiring import build_engine, load_engine_tokenizer

logger = logging.getLogger(__name__)
CLIENT_ID = "async-engine"
T = TypeVar("T")


@dataclass(frozen=True)
class WatchStats:
    """What the supervisor sees (`AsyncEngine.watch_stats()`): requests ended by the
    request timeout so far, open requests past it now (stuck), the oldest open
    request's age, the seconds since the worker's last heartbeat, and how many times a
    dead worker was replaced (`RestartingEngine`)."""

    num_timed_out: int
    num_over_deadline: int
    oldest_request_s: float
    worker_silent_s: float
    num_restarts: int = 0


@dataclass
class _OpenStream:
    """A request being streamed: where its outputs go, and when it started."""

    queue: asyncio.Queue[OutputDelta] = field(default_factory=asyncio.Queue)
    started: float = field(default_factory=time.monotonic)  # monotonic


@dataclass(frozen=True)
class Supervision:
    """How the engine watches its worker and its requests: a worker whose heartbeats
    stop for `worker_timeout_s` is stalled; a request still open after
    `request_timeout_s` (None: no limit) is ended with a timeout error; both are checked
    every `interval_s`."""

    worker_timeout_s: float = 5.0
    request_timeout_s: float | None = None
    interval_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s}")


class AsyncEngine:
    """Start with `await AsyncEngine.start(args)`; stream with `async for out in
    engine.generate(prompt_or_messages, params, request_id)`; `await engine.abort(id)`;
    `await engine.shutdown()` (no orphan processes, no stale ipc files).
    `await engine.tokenize(prompt_or_messages)` / `await engine.detokenize(ids)` answer a
    TokenizeResult (ValueError naming the field for input refused).

    Every stream ends: with its outputs' finish reasons, or with one request-wide
    OutputDelta (index -1) saying "abort" or "error" (`error_kind` says whose fault)."""

    def __init__(self, supervision: Supervision) -> None:
        self.supervision = supervision
        self._streams: dict[str, _OpenStream] = {}
        self._calls: dict[str, asyncio.Future[TokenizeResult]] = {}  # tokenize, detokenize
        self._ids = itertools.count()
        self.error: str | None = None  # set while the engine is unhealthy
        self.num_timed_out = 0
        self._stalled = False
        self._closing = False
        self._renderer: IsolatedRenderer | None = None  # chat templates, in child processes
        self.ended = asyncio.Event()  # set once shut down, for whatever reason

    @property
    def is_healthy(self) -> bool:
        return self.error is None

    @property
    def status(self) -> EngineStatus:
        return EngineStatus.OK if self.error is None else EngineStatus.UNHEALTHY

    def replica_statuses(self) -> tuple[EngineStatus, ...]:
        """One engine: one replica."""
        return (self.status,)

    def replica_stats(self) -> tuple[EngineStats, ...]:
        return (self.stats(),)

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        pipeline_depth: int = 2,
        ready_timeout: float = 300.0,
        supervision: Supervision | None = None,
        config: EngineConfig | None = None,
        launch: WorkerLaunch | None = None,
    ) -> AsyncEngine:
        """Starts the engine for `args`. `config`: `args.build()`, when the caller has
        built it already. `launch`: the worker, when the caller launched it already
        (`WorkerLaunch.start(args)`, so that the model loads while the caller starts);
        the engine owns it from here on, whether the start succeeds or not.

        Start-up overlaps the two processes: while the worker loads the model and sizes
        its KV cache, this process builds the config and loads the tokenizer (a thread);
        a failure of either fails the start at once (see `_start_up`)."""
        self = cls(supervision or Supervision())
        launch = launch or WorkerLaunch.start(args)
        self._launch, self._run_dir = launch, launch.run_dir
        self._workers, self._worker = launch.processes, launch.process  # all ranks; rank 0
        self._ctx = zmq.asyncio.Context()
        sched_inbox, self._monitors = None, []
        try:
            if launch.args != args:
                raise ValueError("the worker was launched for other engine arguments")
            sched_inbox = zmq_inbox(self._ctx, launch.scheduler_address)
            for process, address in zip(launch.processes, launch.heartbeat_addresses, strict=True):
                self._monitors.append(WorkerMonitor(process, address))
            if launch.head is not None:  # ranks on other hosts: their heartbeats
                self._monitors.extend(launch.head.monitors)
            ready, (config, tokenizer) = await self._start_up(
                args, config, sched_inbox, ready_timeout
            )
            remote = launch.head.plan_addresses() if launch.head is not None else {}
        except BaseException:  # no engine: leave no process, socket or run dir behind
            launch.abandon()
            if self._renderer is not None:
                self._renderer.close()
            for closable in (*self._monitors, sched_inbox):
                if closable is not None:
                    closable.close()
            self._ctx.term()
            raise
        parts = build_engine(config, ready, with_block_manager=True, tokenizer=tokenizer)
        self.ready = ready  # what the worker found at start-up (blocks, attention backend)
        to_tokenizer, tokenizer_inbox = inproc_pair()
        to_client, self._client_inbox = inproc_pair()
        to_blocks, blocks_inbox = inproc_pair()
        to_replies, replies_inbox = inproc_pair()
        self._to_workers = [zmq_outbox(self._ctx, a) for a in launch.worker_addresses]
        for rank, address in remote.items():  # ranks on other hosts: sealed plans over tcp
            self._to_workers.append(zmq_outbox(self._ctx, address, launch.head.plan_auth(rank)))
        self.block_manager = BlockManagerActor(parts.block_manager, blocks_inbox, to_replies)
        self.scheduler = SchedulerActor(
            parts.core,
            sched_inbox,
            self._to_workers,  # every rank runs every plan; rank 0 answers
            to_tokenizer,
            to_blocks,
            replies_inbox,
            pipeline_depth,
        )
        self.tokenizer = TokenizerActor(
            parts.processor,
            tokenizer_inbox,
            zmq_outbox(self._ctx, launch.scheduler_address),
            {CLIENT_ID: to_client},
        )
        self._to_tokenizer = to_tokenizer
        await self.block_manager.start()
        await self.scheduler.start()
        await self.tokenizer.start()
        self._reader = asyncio.create_task(self._read_outputs())
        self._watchdog = asyncio.create_task(self._watch())
        return self

    async def _start_up(
        self, args: EngineArgs, config: EngineConfig | None, inbox, timeout: float
    ) -> tuple[WorkerReady, tuple[EngineConfig, Tokenizer | None]]:
        """The worker's ready message, and this process's config and tokenizer (loaded
        on a thread meanwhile: they need no `WorkerReady`). A failure here is raised at
        once; so is the worker's exit, unless this process's failure follows (a config
        that cannot load says why better than the worker's exit code)."""

        def prepare() -> tuple[EngineConfig, Tokenizer | None]:
            built = config or args.build()  # config.json only; the worker holds the weights
            tokenizer = load_engine_tokenizer(built)
            self._renderer = isolate_templates(tokenizer)  # checks that the template renders
            return built, tokenizer

        ready = asyncio.ensure_future(self._since_launch(self._worker_ready(inbox, timeout)))
        prepared = asyncio.ensure_future(self._since_launch(asyncio.to_thread(prepare)))
        try:
            await asyncio.wait({ready, prepared}, return_when=asyncio.FIRST_EXCEPTION)
            if ready.done() and ready.exception() is not None:
                await asyncio.wait({prepared})
            parent, parent_s = await prepared
            worker, worker_s = await ready
        finally:
            ready.cancel()
            prepared.cancel()
        logger.info(
            "worker 0 ready %.2f s after its launch; config and tokenizer here after %.2f s",
            worker_s,
            parent_s,
        )
        return worker, parent

    async def _since_launch(self, step: Awaitable[T]) -> tuple[T, float]:
        """`step`'s result, and the seconds from the worker's launch until it came."""
        result = await step
        return result, time.monotonic() - self._launch.launched_at

    async def _worker_ready(self, inbox, timeout: float) -> WorkerReady:
        """The worker's ready message, or an error as soon as its process exits (a model
        that cannot load fails the start at once, not after `timeout`)."""
        waiting = asyncio.ensure_future(
            await_ready(
                inbox, InboxDecoder(INBOXES["scheduler"]), WorkerReady, timeout, sender="worker 0"
            )
        )
        try:
            while not waiting.done():
                for rank, process in enumerate(self._workers):
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

    async def generate(
        self,
        prompt: str | list[int] | list[dict],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """Yields incremental outputs until every sequence (`params.n`, each under its
        `index`) has a finish reason, or a request-wide one (index -1) arrives.
        `strict_max_tokens`: see GenerateRequest."""
        request_id = request_id or f"req-{next(self._ids)}"
        check_request_id(request_id)
        if self.error is not None:
            raise RuntimeError(f"the engine is not healthy: {self.error}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        params = params or SamplingParams()
        request = GenerateRequest.of(
            request_id, CLIENT_ID, prompt, params, strict_max_tokens=strict_max_tokens
        )
        stream = self._streams[request_id] = _OpenStream()
        finished, open_sequences = False, params.n
        try:
            await send_message(self._to_tokenizer, request)
            while not finished:
                out = await stream.queue.get()
                if out.finish_reason is not None:
                    open_sequences = 0 if out.index < 0 else open_sequences - 1
                finished = open_sequences == 0
                yield out
        finally:
            del self._streams[request_id]
            if not finished:
                await self.abort(request_id)  # the caller stopped reading early

    async def tokenize(
        self,
        prompt: str | list[dict],
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> TokenizeResult:
        """A text's token ids (`add_special_tokens`: BOS and the like), or a chat's
        ({"role", "content"} dicts, through the chat template), as `generate` would
        tokenize them, with each token's text."""
        rid = f"tokenize-{next(self._ids)}"
        if isinstance(prompt, str):
            message = TokenizeRequest(rid, CLIENT_ID, prompt, None, add_special_tokens)
        else:
            chat = chat_of(prompt)
            message = TokenizeRequest(rid, CLIENT_ID, None, chat, True, add_generation_prompt)
        return await self._call(message)

    async def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool = False
    ) -> TokenizeResult:
        """The text of `token_ids` (special tokens kept unless skipped), with each
        token's text."""
        rid = f"detokenize-{next(self._ids)}"
        ids = tuple(token_ids)
        return await self._call(DetokenizeRequest(rid, CLIENT_ID, ids, skip_special_tokens))

    async def _call(self, message: TokenizeRequest | DetokenizeRequest) -> TokenizeResult:
        """Sends `message` to the tokenizer actor and waits for its answer; ValueError
        for input it refused, RuntimeError when the engine fails or stops meanwhile."""
        if self.error is not None:
            raise RuntimeError(f"the engine is not healthy: {self.error}")
        answer = self._calls[message.request_id] = asyncio.get_running_loop().create_future()
        try:
            await send_message(self._to_tokenizer, message)
            result = await answer
        finally:
            del self._calls[message.request_id]
        if result.error_kind is ErrorKind.BUSY:
            raise EngineBusy(result.error)
        if result.error is not None:
            raise ValueError(result.error)
        return result

    async def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """How many prompt tokens chat `messages` would take (the chat template applied);
        ValueError when they cannot be rendered (no tokenizer, a template error);
        RuntimeError while the engine is not healthy."""
        if self.error is not None or self._closing:
            raise RuntimeError(f"the engine is not healthy: {self.error or 'shutting down'}")
        return await self.tokenizer.count_prompt_tokens(messages)

    async def abort(self, request_id: str) -> None:
        """Stops a request; its stream (if still read) ends with finish_reason "abort"."""
        await self._end(request_id, OutputDelta.aborted(request_id))

    async def _end(self, request_id: str, final: OutputDelta) -> None:
        """Ends an open stream with `final` and stops the request in the engine."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(final)
        if not self._closing:
            await send_message(self._to_tokenizer, AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """The engine core's stats: the keys `LLM.stats()` has."""
        return self.scheduler.core.stats()

    def watch_stats(self) -> WatchStats:
        now = time.monotonic()
        ages = [now - stream.started for stream in self._streams.values()]
        limit = self.supervision.request_timeout_s
        return WatchStats(
            self.num_timed_out,
            sum(age > limit for age in ages) if limit is not None else 0,
            max(ages, default=0.0),
            max(monitor.check().silent_s for monitor in self._monitors),
        )

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the actors and the worker process; idempotent. Sets `ended`."""
        try:
            await self._shut_down(timeout)
        finally:
            self.ended.set()

    async def _shut_down(self, timeout: float) -> None:
        self._closing = True
        self._fail_calls("the engine shut down")
        for to_worker in self._to_workers:
            with contextlib.suppress(Exception):
                await send_message(to_worker, Shutdown("engine shutdown"))
        await self.tokenizer.stop()
        await self.scheduler.stop()
        await self.block_manager.stop()
        for task in (self._reader, self._watchdog):
            if task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._ctx.closed:
            return
        await asyncio.to_thread(_wait_or_kill, self._workers, timeout)
        if self._renderer is not None:
            self._renderer.close()
        for closable in (*self._to_workers, *self._monitors):
            closable.close()
        self._ctx.term()
        shutil.rmtree(self._run_dir, ignore_errors=True)
        if self._launch.head is not None:
            self._launch.head.close()  # its store stops: remote ranks still up exit

    async def _watch(self) -> None:
        """The supervisor's loop (see the module doc)."""
        actors = (self.tokenizer, self.scheduler, self.block_manager)
        while True:
            await asyncio.sleep(self.supervision.interval_s)
            health = [monitor.check() for monitor in self._monitors]
            exited = next((r for r, h in enumerate(health) if h.exit_code is not None), None)
            dead = next((a for a in actors if not a.is_alive), None)
            if exited is not None or dead is not None:
                break
            silent = max(range(len(health)), key=lambda r: health[r].silent_s)
            if await self._check_stall(silent, health[silent].silent_s):
                break
            await self._expire_requests()
        if self._closing:
            return
        error = self.error  # a stalled rank under tensor parallelism (_check_stall)
        if exited is not None:
            error = f"worker process {exited} exited with code {health[exited].exit_code}"
        elif dead is not None:
            error = f"the {dead.name} actor stopped: {dead.crash!r}"
        await self.fail(error or "the engine stopped")

    async def fail(self, error: str) -> None:
        """Ends every open request with `error`, kills the workers still running (under
        tensor parallelism the others wait in collectives for a lost rank; a stalled one
        may never answer) and shuts the engine down, unhealthy for good."""
        self.error = error
        logger.error("%s; failing %d open requests", error, len(self._streams))
        await self._fail_all(error)
        await asyncio.to_thread(kill_processes, self._workers)
        await self.shutdown()

    async def _check_stall(self, rank: int, silent_s: float) -> bool:
        """A silent worker makes the engine unhealthy and fails every open request; its
        heartbeats coming back make it healthy again. Under tensor parallelism a silent
        rank holds the others in their collectives: True, the group must go down."""
        timeout = self.supervision.worker_timeout_s
        if silent_s > timeout and not self._stalled:
            self._stalled = True
            self.error = (
                f"worker {rank} has sent no heartbeat for {silent_s:.1f} s (timeout "
                f"{timeout:g} s: frozen or overloaded); open requests were failed"
            )
            if self._launch.world_size > 1:
                return True
            logger.error("%s (%d requests)", self.error, len(self._streams))
            await self._fail_all(self.error)
        elif silent_s <= timeout and self._stalled:
            self._stalled = False
            self.error = None
            logger.warning("worker %d answers again; the engine is healthy", rank)
        return False

    async def _expire_requests(self) -> None:
        limit = self.supervision.request_timeout_s
        if limit is None:
            return
        now = time.monotonic()
        late = [r for r, stream in self._streams.items() if now - stream.started > limit]
        for request_id in late:
            self.num_timed_out += 1
            error = f"the request ran past the server's request timeout of {limit:g} s"
            await self._end(request_id, OutputDelta.failed(request_id, error, ErrorKind.TIMEOUT))

    async def _fail_all(self, error: str) -> None:
        for request_id in list(self._streams):
            await self._end(request_id, OutputDelta.failed(request_id, error))
        self._fail_calls(error)

    def _fail_calls(self, error: str) -> None:
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(RuntimeError(error))

    async def _read_outputs(self) -> None:
        decoder = InboxDecoder(INBOXES["client"])
        while True:
            frame = await self._client_inbox.recv()
            try:
                out = decoder.decode(frame)
            except DecodeError as exc:  # in-process: a bug, but never a hang
                logger.error("dropped an output: %s", exc)
                if exc.request_id in self._streams:
                    error = f"an output could not be decoded: {exc}"
                    await self._end(exc.request_id, OutputDelta.failed(exc.request_id, error))
                continue
            if isinstance(out, TokenizeResult) or out.request_id in self._calls:
                answer = self._calls.get(out.request_id)
                if answer is None or answer.done():
                    continue  # its caller left
                if isinstance(out, TokenizeResult):
                    answer.set_result(out)
                else:  # the tokenizer actor failed it (the failure rule)
                    answer.set_exception(RuntimeError(out.error or "tokenizing failed"))
                continue
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)


def _wait_or_kill(processes, timeout: float) -> None:
    """Waits up to `timeout` seconds in all for the processes to exit, then kills the rest."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    kill_processes(processes)
