"""`AsyncEngine`: one engine, the `EngineClient` that web handlers and the SDK talk to.

Its workers are processes (`python -m actors.worker_actor`, over ZeroMQ ipc) whose start
`start_up` races against this process's config and tokenizer (actors/engine_start.py);
its actors (an `EngineGraph`: tokenizer, scheduler, block manager) run on the caller's
event loop; a `Supervisor` watches both and the open requests. The client itself is
thin: it sends requests and tokenize calls to the tokenizer actor, hands what comes
back to each stream or call by request id, and shuts the pieces down in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from actors.actor import send_message
from actors.engine_graph import EngineGraph
from actors.engine_start import StartUp, start_up
from actors.engine_status import EngineStatus
from actors.request_ids import RequestIds, refuse_open
from actors.supervisor import Supervision, Supervisor, WatchStats
from actors.tokenize_calls import TokenizeCalls
from actors.transport import Inbox, inproc_pair
from actors.worker_launch import WorkerLaunch, kill_processes
from engine.codec import DecodeError, InboxDecoder
from engine.config import EngineConfig
from engine.core.stats import EngineStats
from engine.engine_args import EngineArgs
from engine.messages import (
    INBOXES,
    AbortRequest,
    ChatInput,
    ChatPrompt,
    DetokenizeRequest,
    GenerateRequest,
    OutputDelta,
    PromptInput,
    TokenizeRequest,
    TokenizeResult,
    WorkerReady,
    chat_of,
)
from engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Supervision", "WatchStats"]  # the last two: where they were

logger = logging.getLogger(__name__)
CLIENT_ID = "async-engine"


@dataclass
class _OpenStream:
    """A request being streamed: where its outputs go, and when it started."""

    queue: asyncio.Queue[OutputDelta] = field(default_factory=asyncio.Queue)
    started: float = field(default_factory=time.monotonic)  # monotonic


class AsyncEngine:
    """Start with `await AsyncEngine.start(args)`; then the `EngineClient` calls
    (`generate`, `abort`, `tokenize`, ...) and `await engine.shutdown()`. `fail(error)`
    ends every open request with `error` and the engine for good; `ended` is set once it
    has shut down, for whatever reason. `launch` is its workers; `graph` its actors."""

    def __init__(
        self, boot: StartUp, graph: EngineGraph, outputs: Inbox, supervision: Supervision
    ) -> None:
        """A started engine (see `start`); `outputs`: the tokenizer's, to this client."""
        self.launch = boot.launch
        self.graph = graph
        self._boot = boot
        self._outputs = outputs
        self._streams: dict[str, _OpenStream] = {}
        self._calls = TokenizeCalls()
        self._ids = RequestIds()
        self._failure: str | None = None  # set once failed, for good
        self._closing = False
        self.ended = asyncio.Event()  # set once shut down, for whatever reason
        self.supervisor = Supervisor(
            supervision,
            boot.monitors,
            graph.actors,
            boot.launch.world_size,
            open_since=lambda: {rid: s.started for rid, s in self._streams.items()},
            end=self._end,
            fail_open=self._fail_all,
            lost=self._on_lost,
        )
        self._reader = asyncio.create_task(self._read_outputs())
        self._watchdog = asyncio.create_task(self.supervisor.run())

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
        the engine owns it from here on, whether the start succeeds or not."""
        supervision = supervision or Supervision()
        boot = await start_up(args, config, launch or WorkerLaunch.start(args), ready_timeout)
        to_client, outputs = inproc_pair()
        graph = boot.build_graph(pipeline_depth, {CLIENT_ID: to_client})
        await graph.start()
        return cls(boot, graph, outputs, supervision)

    @property
    def ready(self) -> WorkerReady:
        return self._boot.ready

    @property
    def error(self) -> str | None:
        """Why the engine failed, or why it is unhealthy now (a stalled worker)."""
        return self._failure if self._failure is not None else self.supervisor.stall_error

    @property
    def is_healthy(self) -> bool:
        return self.error is None

    @property
    def status(self) -> EngineStatus:
        return EngineStatus.OK if self.error is None else EngineStatus.UNHEALTHY

    def replica_statuses(self) -> tuple[EngineStatus, ...]:
        return (self.status,)

    def replica_stats(self) -> tuple[EngineStats, ...]:
        return (self.stats(),)

    def stats(self) -> EngineStats:
        return self.graph.scheduler.core.stats()

    def watch_stats(self) -> WatchStats:
        return self.supervisor.watch_stats()

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        request_id = self._ids.claim(request_id, "req")
        if self.error is not None:
            raise RuntimeError(f"the engine is not healthy: {self.error}")
        refuse_open(request_id, self._streams)
        params = params or SamplingParams()
        request = GenerateRequest.of(
            request_id, CLIENT_ID, prompt, params, strict_max_tokens=strict_max_tokens
        )
        stream = self._streams[request_id] = _OpenStream()
        finished, open_sequences = False, params.n
        try:
            await send_message(self.graph.to_tokenizer, request)
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
        prompt: str | ChatInput,
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> TokenizeResult:
        rid = self._ids.mint("tokenize")
        if isinstance(prompt, str):
            message = TokenizeRequest.of_prompt(
                rid, CLIENT_ID, prompt, add_special_tokens=add_special_tokens
            )
        else:
            chat = prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(chat_of(prompt))
            message = TokenizeRequest.of_chat(
                rid,
                CLIENT_ID,
                chat.messages,
                add_generation_prompt=add_generation_prompt,
                template_args=chat.template_args,
            )
        return await self._call(message)

    async def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool = False
    ) -> TokenizeResult:
        rid = self._ids.mint("detokenize")
        ids = tuple(token_ids)
        return await self._call(DetokenizeRequest(rid, CLIENT_ID, ids, skip_special_tokens))

    async def _call(self, message: TokenizeRequest | DetokenizeRequest) -> TokenizeResult:
        """RuntimeError while the engine is unhealthy, or when it fails or stops meanwhile."""
        if self.error is not None:
            raise RuntimeError(f"the engine is not healthy: {self.error}")
        return await self._calls.call(message, self.graph.to_tokenizer)

    async def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        if self.error is not None or self._closing:
            raise RuntimeError(f"the engine is not healthy: {self.error or 'shutting down'}")
        return await self.graph.tokenizer.count_prompt_tokens(messages)

    async def abort(self, request_id: str) -> None:
        await self._end(request_id, OutputDelta.aborted(request_id))

    async def _end(self, request_id: str, final: OutputDelta) -> None:
        """Ends an open stream with `final` and stops the request in the engine."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(final)
        if not self._closing:
            await send_message(self.graph.to_tokenizer, AbortRequest(request_id))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the actors, then the workers (waiting up to `timeout` seconds for them
        to exit); idempotent. Sets `ended`."""
        try:
            self._closing = True
            self._calls.fail("the engine shut down")
            await self.graph.shut_down_workers("engine shutdown")
            await self.graph.stop()
            for task in (self._reader, self._watchdog):
                if task is not asyncio.current_task():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self._boot.release(timeout)
        finally:
            self.ended.set()

    async def fail(self, error: str) -> None:
        """Ends every open request with `error`, kills the workers still running (under
        tensor parallelism the others wait in collectives for a lost rank; a stalled one
        may never answer) and shuts the engine down, unhealthy for good."""
        self._failure = error
        logger.error("%s; failing %d open requests", error, len(self._streams))
        await self._fail_all(error)
        await asyncio.to_thread(kill_processes, self.launch.processes)
        await self.shutdown()

    async def _on_lost(self, error: str) -> None:
        """The supervisor's verdict: the engine is lost (unless it is shutting down)."""
        if not self._closing:
            await self.fail(error)

    async def _fail_all(self, error: str) -> None:
        for request_id in list(self._streams):
            await self._end(request_id, OutputDelta.failed(request_id, error))
        self._calls.fail(error)

    async def _read_outputs(self) -> None:
        """Hands each output to its stream, each answer to its tokenize call."""
        decoder = InboxDecoder(INBOXES["client"])
        while True:
            frame = await self._outputs.recv()
            try:
                out = decoder.decode(frame)
            except DecodeError as exc:  # in-process: a bug, but never a hang
                logger.error("dropped an output: %s", exc)
                if exc.request_id in self._streams:
                    error = f"an output could not be decoded: {exc}"
                    await self._end(exc.request_id, OutputDelta.failed(exc.request_id, error))
                continue
            if isinstance(out, TokenizeResult) or out.request_id in self._calls:
                self._calls.answer(out)
            elif (stream := self._streams.get(out.request_id)) is not None:
                stream.queue.put_nowait(out)
