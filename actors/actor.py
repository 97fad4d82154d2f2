"""The actor base: one asyncio loop task, one typed inbox, explicit dispatch by message type.

An actor's loop is recv -> decode -> dispatch, until `stop()` or a `Shutdown` message.
Nothing a peer sends can kill it: a frame that does not decode is logged and dropped
(`num_dropped`), a handler that raises is logged and counted (`num_errors`), and the loop
goes on. Start-up values travel in a ready message (`await_ready`), never in shared state.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from actors.codec import DecodeError, InboxDecoder, encode
from actors.transport import Inbox, Outbox
from engine.messages import Shutdown

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[None] | None]
M = TypeVar("M")


class ActorStartupError(RuntimeError):
    """A peer did not announce itself ready in time."""


class Actor:
    """One asyncio loop task over one inbox, dispatching each message to `handlers[type]`.

    Contract:
    - The inbox accepts exactly the handlers' message types plus `Shutdown`; its decoder
      rejects everything else. Handlers may be coroutine functions or plain functions.
    - Messages are handled one at a time, in arrival order.
    - `Shutdown` runs its handler if one is registered, then the loop ends.
    - A handler exception is logged, counted in `num_errors` and passed to
      `on_handler_error`; an exception raised by `on_handler_error` ends the loop (that is
      how a subclass makes errors fatal), leaving it in `crash` and `is_alive` False.
    - A handler may await an answer on one of its `reply_inboxes` (a request/answer
      exchange with a peer); no other message is handled meanwhile.
    - When the loop ends, the actor closes its inbox and the `outboxes` and
      `reply_inboxes` it was given.
    """

    def __init__(
        self,
        name: str,
        inbox: Inbox,
        handlers: Mapping[type, Handler],
        outboxes: Iterable[Outbox] = (),
        reply_inboxes: Iterable[Inbox] = (),
    ) -> None:
        self.name = name
        self.inbox = inbox
        self.handlers = dict(handlers)
        self.decoder = InboxDecoder({*self.handlers, Shutdown})
        self.outboxes = list(outboxes)
        self.reply_inboxes = list(reply_inboxes)
        self.num_received = 0
        self.num_dropped = 0
        self.num_errors = 0
        self.last_activity = time.monotonic()
        self.crash: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._receiving = False
        self._closed = False

    @property
    def is_alive(self) -> bool:
        """The loop task is running (started, not stopped, not crashed)."""
        return self._task is not None and not self._task.done()

    async def run(self) -> None:
        """The loop: recv -> decode -> dispatch, until stop() or Shutdown."""
        try:
            while not self._stopping:
                frame = await self._recv()
                if frame is None:
                    break
                message = self._decode(frame)
                if message is not None:
                    await self._dispatch(message)
        finally:
            self._close_transports()

    async def start(self) -> None:
        """Spawn the loop task on the running event loop."""
        if self._task is not None:
            raise RuntimeError(f"actor {self.name} was already started")
        self._task = asyncio.create_task(self.run(), name=f"actor:{self.name}")
        self._task.add_done_callback(self._on_exit)

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop gracefully and close the transports; idempotent.

        A message being handled finishes first; after `timeout` seconds the loop is
        cancelled. Frames not yet received are discarded. Called from the actor's own
        handler, it only asks the loop to end after that handler returns."""
        self._stopping = True
        task = self._task
        if task is asyncio.current_task():
            return
        if task is not None and not task.done():
            if self._receiving:
                task.cancel()  # wakes the pending recv; _recv turns it into a clean exit
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                log.warning(
                    "actor %s did not stop within %.1f s; cancelling it", self.name, timeout
                )
                task.cancel()
                await asyncio.wait({task}, timeout=timeout)
        self._close_transports()

    async def on_handler_error(self, message: Any, error: Exception) -> None:
        """Called after a handler raised `error` on `message` (already logged); no-op here."""

    async def _recv(self) -> bytes | None:
        """The next frame, or None when stop() interrupted the wait."""
        self._receiving = True
        try:
            return await self.inbox.recv()
        except asyncio.CancelledError:
            if self._stopping:
                return None
            raise
        finally:
            self._receiving = False

    def _decode(self, frame: bytes) -> Any | None:
        self.num_received += 1
        self.last_activity = time.monotonic()
        try:
            return self.decoder.decode(frame)
        except DecodeError as exc:
            self.num_dropped += 1
            what = f"{len(frame)}-byte frame" if isinstance(frame, bytes) else "message"
            log.warning("actor %s dropped a %s: %s", self.name, what, exc)
            return None

    async def _dispatch(self, message: Any) -> None:
        handler = self.handlers.get(type(message))
        try:
            if handler is not None:
                result = handler(message)
                if inspect.isawaitable(result):
                    await result
        except Exception as exc:
            self.num_errors += 1
            log.exception("actor %s: handler for %s failed", self.name, type(message).__name__)
            await self.on_handler_error(message, exc)
        if isinstance(message, Shutdown):
            log.info("actor %s shutting down: %s", self.name, message.reason)
            self._stopping = True

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.crash = task.exception()
            log.error("actor %s crashed", self.name, exc_info=self.crash)

    def _close_transports(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.inbox.close()
        for inbox in self.reply_inboxes:
            inbox.close()
        for outbox in self.outboxes:
            outbox.close()


async def send_message(outbox: Outbox, message: Any) -> None:
    """Send one message: as one encoded frame, or as itself over an in-process queue."""
    await outbox.send(message if outbox.carries_messages else encode(message))


async def await_ready(
    inbox: Inbox,
    decoder: InboxDecoder,
    expect: type[M],
    timeout: float,
    *,
    sender: str = "peer",
) -> tuple[M, list[Any]]:
    """Wait for the first `expect` message on `inbox` (e.g. a worker's `WorkerReady`).

    Returns `(ready_message, early_messages)`: valid messages that arrived before it, in
    order, for the caller to handle (nothing is lost). Undecodable frames are logged and
    dropped. Raises ActorStartupError, naming `sender`, if none arrives within `timeout`
    seconds. Call it before an actor starts reading the same inbox."""
    if expect.__name__ not in decoder.types:
        accepted = sorted(decoder.types)
        raise ValueError(f"{expect.__name__} is not among this decoder's types {accepted}")
    early: list[Any] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                frame = await inbox.recv()
                try:
                    message = decoder.decode(frame)
                except DecodeError as exc:
                    log.warning("dropped a frame while waiting for %s: %s", expect.__name__, exc)
                    continue
                if isinstance(message, expect):
                    return message, early
                early.append(message)
    except TimeoutError:
        raise ActorStartupError(
            f"{sender} sent no {expect.__name__} within {timeout:g} s "
            f"({len(early)} other messages arrived first); check that it started and its log"
        ) from None
