"""The tokenizer actor: one TextProcessor between clients and the scheduler.

Text work runs off the event loop: tokenizing a prompt (a megabyte of text takes about a
second) and detokenizing a step's tokens run on one thread of the actor's own, so the
loop that the scheduler and the web layer share keeps serving meanwhile. One thread, and
one message at a time: the processor is never used from two threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox
from engine.errors import describe
from engine.messages import (
    AbortRequest,
    ErrorKind,
    GenerateRequest,
    OutputDelta,
    RequestFailed,
    TokenDeltas,
)
from engine.text_processor import TextProcessor

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _StepText:
    """What one TokenDeltas turned into: deltas per client, aborts for the scheduler
    (stop strings), and the sequences whose text work raised."""

    outs: list[tuple[str, OutputDelta]] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (sequence id, error)


class TokenizerActor(Actor):
    """Tokenizes requests for the scheduler and streams text deltas to each client.

    A request that fails validation is answered at once with an `OutputDelta` carrying
    `finish_reason="error"`, `error_kind=INVALID` and the message; nothing reaches the
    scheduler. A request whose handling raised anything else (the failure rule) is
    forgotten, aborted at the scheduler and answered with an engine error; so is one the
    scheduler reports failed (`RequestFailed`). Deltas for a client without an outbox
    are logged and dropped.
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
        }
        super().__init__("tokenizer", inbox, handlers, [scheduler, *clients.values()])
        self.processor = processor
        self.scheduler = scheduler
        self.clients = clients
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    async def on_generate(self, request: GenerateRequest) -> None:
        try:
            add = await self._off_loop(self.processor.admit, request, time.time())
        except ValueError as exc:
            error = OutputDelta.failed(request.request_id, str(exc), ErrorKind.INVALID)
            await self._to_client(request.client_id, error)
            return
        await send_message(self.scheduler, add)

    async def on_abort(self, abort: AbortRequest) -> None:
        self.processor.drop(abort.request_id)
        await send_message(self.scheduler, abort)

    async def on_request_failed(self, failed: RequestFailed) -> None:
        client = self.processor.client_of(failed.request_id)
        self.processor.drop(failed.request_id)
        if client is not None:
            await self._to_client(client, OutputDelta.failed(failed.request_id, failed.error))

    async def on_token_deltas(self, message: TokenDeltas) -> None:
        step = await self._off_loop(self._step_text, message)
        for abort in step.aborts:
            await send_message(self.scheduler, abort)
        for client, out in step.outs:
            await self._to_client(client, out)
        for seq_id, error in step.failed:
            request_id = self.processor.request_of(seq_id)
            logger.warning("text of %s failed: %s", seq_id, error)
            self.num_errors += 1
            await self.fail_request(request_id, error, message)

    def _step_text(self, message: TokenDeltas) -> _StepText:
        """On the actor's thread: every delta's text, each under its own guard."""
        step = _StepText()
        for delta in message.deltas():
            try:
                client = self.processor.client_of(delta.request_id)
                outs, abort = self.processor.on_token_delta(delta)
            except Exception as exc:  # noqa: BLE001 - the failure rule: this request only
                step.failed.append((delta.request_id, describe(exc)))
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

    async def fail_request(self, request_id: str, error: str, message: Any) -> None:
        """Forgets the request, aborts it at the scheduler, tells its client."""
        client = self.processor.client_of(request_id) or getattr(message, "client_id", None)
        self.processor.drop(request_id)
        await send_message(self.scheduler, AbortRequest(request_id))
        if client is not None:
            await self._to_client(client, OutputDelta.failed(request_id, error))

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))

    async def _to_client(self, client_id: str, delta: OutputDelta) -> None:
        outbox = self.clients.get(client_id)
        if outbox is None:
            logger.warning("no outbox for client %r; dropping %s", client_id, delta.request_id)
            return
        await send_message(outbox, delta)

    def _close_transports(self) -> None:
        super()._close_transports()
        self._thread.shutdown(wait=False, cancel_futures=True)
