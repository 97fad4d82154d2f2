"""The tokenizer actor: one TextProcessor between clients and the scheduler.

Text work runs off the event loop that the scheduler and the web layer share, and no
request's text work holds up another's:
- admission (`TextProcessor.prepare`: tokenizing, validating; a megabyte of prompt
  takes about a second) runs as a task of its own on an admission thread, so the actor
  goes on handling other messages, the token deltas of running requests included;
- a chat's template renders first (`TextProcessor.render`, and counting a session's
  tokens) on one of RENDER_THREADS threads of their own: a template that takes its
  whole deadline (actors/template_renderer.py) holds up neither plain requests'
  admission nor the other chats';
- `/tokenize` and `/detokenize` work runs on a thread of its own, so a flood of them
  never queues ahead of a generation request's admission; at most
  MAX_QUEUED_TOKENIZE wait or run at once, and past that one is refused at once as
  BUSY (a 503 to retry), not queued;
- everything that touches the processor's state (registering an admitted request,
  detokenizing a step, forgetting a request) runs on ONE text thread, one call at a
  time: the state is never used from two threads at once.
All are daemon threads: a call stuck on one never keeps the process alive at exit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from actors.actor import Actor, send_message
from actors.daemon_executor import DaemonExecutor
from actors.transport import Inbox, Outbox
from engine.errors import describe
from engine.messages import (
    AbortRequest,
    DetokenizeRequest,
    ErrorKind,
    GenerateRequest,
    OutputDelta,
    PrepareGrammar,
    RequestFailed,
    TokenDeltas,
    TokenizeRequest,
    TokenizeResult,
)
from engine.text.text_processor import TextProcessor

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_QUEUED_TOKENIZE = 64  # /tokenize and /detokenize calls waiting or running
RENDER_THREADS = 4  # chats rendering at once (each render waits on a child process)


@dataclass
class _StepText:
    """What one TokenDeltas turned into: deltas per client, aborts for the scheduler
    (stop strings), and the requests whose text work raised."""

    outs: list[tuple[str, OutputDelta]] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, error)


class TokenizerActor(Actor):
    """Tokenizes requests for the scheduler and streams text deltas to each client.

    A request that fails validation is answered with an `OutputDelta` carrying
    `finish_reason="error"`, `error_kind=INVALID` and the message; nothing reaches the
    scheduler. A request whose handling raised anything else (the failure rule) is
    forgotten, aborted at the scheduler and answered with an engine error; so is one the
    scheduler reports failed (`RequestFailed`). A request aborted while it is being
    admitted never reaches the scheduler. Deltas for a client without an outbox are
    logged and dropped.

    A TokenizeRequest or DetokenizeRequest is answered with a TokenizeResult, its work
    done on the admission thread (it touches no request state).
    """

    def __init__(
        self,
        processor: TextProcessor,
        inbox: Inbox,
        scheduler: Outbox,
        clients: dict[str, Outbox],
    ) -> None:
        handlers = {
            GenerateRequest: self.on_generate,
            AbortRequest: self.on_abort,
            TokenDeltas: self.on_token_deltas,
            RequestFailed: self.on_request_failed,
            TokenizeRequest: self.on_tokenize,
            DetokenizeRequest: self.on_tokenize,
        }
        super().__init__("tokenizer", inbox, handlers, [scheduler, *clients.values()])
        self.processor = processor
        self.scheduler = scheduler
        self.clients = clients
        self.admitting: dict[str, asyncio.Task[None]] = {}
        self.tokenizing: set[asyncio.Task[None]] = set()
        self._admission = DaemonExecutor(1, "admission")
        self._render = DaemonExecutor(RENDER_THREADS, "render")
        self._tokenize_thread = DaemonExecutor(1, "tokenize")
        self._text = DaemonExecutor(1, "text")

    async def on_generate(self, request: GenerateRequest) -> None:
        rid = request.request_id
        if rid in self.admitting:
            error = f"request_id {rid!r} is already in flight"
            await self._to_client(
                request.client_id, OutputDelta.failed(rid, error, ErrorKind.INVALID)
            )
            return
        self.admitting[rid] = asyncio.create_task(self._admit(request), name=f"admit:{rid}")

    async def _admit(self, request: GenerateRequest) -> None:
        """Prepares the request on the admission thread, then registers it and hands it
        to the scheduler (unless it was aborted meanwhile)."""
        rid = request.request_id
        try:
            async with self.guard(rid, request):
                try:
                    constraint = request.params.structured_outputs
                    if constraint is not None:  # the worker compiles while we check it
                        await send_message(self.scheduler, PrepareGrammar(constraint))
                    rendered = None  # a chat's text, rendered apart from the admission thread
                    if request.messages is not None:
                        rendered = await self._run(self._render, self.processor.render, request)
                    prepare = self.processor.prepare
                    token_ids = await self._run(self._admission, prepare, request, rendered)
                    add = await self._on_text(
                        self.processor.register, request, token_ids, time.time()
                    )
                except ValueError as exc:
                    error = OutputDelta.failed(rid, str(exc), ErrorKind.INVALID)
                    await self._to_client(request.client_id, error)
                    return
                await send_message(self.scheduler, add)
        finally:
            if self.admitting.get(rid) is asyncio.current_task():  # not a later namesake
                del self.admitting[rid]

    async def on_tokenize(self, request: TokenizeRequest | DetokenizeRequest) -> None:
        if len(self.tokenizing) >= MAX_QUEUED_TOKENIZE:
            error = (
                f"{MAX_QUEUED_TOKENIZE} tokenize calls are already queued or running; retry shortly"
            )
            busy = TokenizeResult.refused(request.request_id, error, ErrorKind.BUSY)
            await self._to_client(request.client_id, busy)
            return
        task = asyncio.create_task(self._tokenize(request), name=f"tokenize:{request.request_id}")
        self.tokenizing.add(task)
        task.add_done_callback(self.tokenizing.discard)

    async def _tokenize(self, request: TokenizeRequest | DetokenizeRequest) -> None:
        try:
            result = await self._run(self._tokenize_thread, self.processor.tokenize, request)
        except Exception as exc:  # noqa: BLE001 - a bug, answered rather than left hanging
            logger.exception("tokenizing %s failed", request.request_id)
            error = f"internal error: {exc!r}"
            result = TokenizeResult.refused(request.request_id, error, ErrorKind.ENGINE)
        await self._to_client(request.client_id, result)

    async def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """`TextProcessor.count_prompt_tokens` on a render thread (read-only)."""
        return await self._run(self._render, self.processor.count_prompt_tokens, messages)

    async def on_abort(self, abort: AbortRequest) -> None:
        admitting = self.admitting.pop(abort.request_id, None)
        if admitting is not None:
            admitting.cancel()  # its client has its own "abort" already
        await self._on_text(self.processor.drop, abort.request_id)
        await send_message(self.scheduler, abort)

    async def on_request_failed(self, failed: RequestFailed) -> None:
        client = await self._on_text(self._forget, failed.request_id)
        if client is not None:
            await self._to_client(client, OutputDelta.failed(failed.request_id, failed.error))

    async def on_token_deltas(self, message: TokenDeltas) -> None:
        step = await self._on_text(self._step_text, message)
        for abort in step.aborts:
            await send_message(self.scheduler, abort)
        for client, out in step.outs:
            await self._to_client(client, out)
        for request_id, error in step.failed:
            logger.warning("text of %s failed: %s", request_id, error)
            self.num_errors += 1
            await self.fail_request(request_id, error, message)

    def _step_text(self, message: TokenDeltas) -> _StepText:
        """On the text thread: every delta's text, each under its own guard."""
        step = _StepText()
        for delta in message.deltas():
            request_id = self.processor.request_of(delta.request_id)  # n > 1: its sequence
            try:
                client = self.processor.client_of(delta.request_id)
                outs, abort = self.processor.on_token_delta(delta)
            except Exception as exc:  # noqa: BLE001 - the failure rule: this request only
                step.failed.append((request_id, describe(exc)))
                continue
            if abort is not None:
                step.aborts.append(abort)
            step.outs += [(client, out) for out in outs] if client is not None else []
        if message.ranked:
            try:
                step.outs += self.processor.on_ranked(message.ranked, message.prompt_logprobs)
            except Exception as exc:  # noqa: BLE001 - a beam search's outputs, whole
                step.failed += [(seq.request_id, describe(exc)) for seq in message.ranked[:1]]
        return step

    def _forget(self, request_id: str) -> str | None:
        """On the text thread: drops the request; returns its client (None: unknown)."""
        client = self.processor.client_of(request_id)
        self.processor.drop(request_id)
        return client

    async def fail_request(self, request_id: str, error: str, message: Any) -> None:
        """Forgets the request, aborts it at the scheduler, tells its client."""
        client = await self._on_text(self._forget, request_id)
        client = client or getattr(message, "client_id", None)
        await send_message(self.scheduler, AbortRequest(request_id))
        if client is not None:
            await self._to_client(client, OutputDelta.failed(request_id, error))

    async def _on_text(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run(self._text, fn, *args)

    @staticmethod
    async def _run(thread: DaemonExecutor, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(thread, functools.partial(fn, *args))

    async def _to_client(self, client_id: str, message: OutputDelta | TokenizeResult) -> None:
        outbox = self.clients.get(client_id)
        if outbox is None:
            logger.warning("no outbox for client %r; dropping %s", client_id, message.request_id)
            return
        await send_message(outbox, message)

    def _close_transports(self) -> None:
        for task in [*self.admitting.values(), *self.tokenizing]:
            task.cancel()
        super()._close_transports()
        for thread in (self._admission, self._render, self._tokenize_thread, self._text):
            thread.shutdown(wait=False, cancel_futures=True)
