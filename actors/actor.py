"""The actor base: one asyncio loop task, one typed inbox, explicit dispatch by message type.

An actor's loop is recv -> decode -> dispatch -> after_message, until `stop()` or a
`Shutdown` message. The failure rule lives here, once for every actor: an exception
while a request is being handled ends THAT request (`fail_request`: its client gets an
error, everything it holds is released) and the loop goes on; an exception that cannot
be tied to one request ends the loop (`crash`), and the engine's supervisor fails every
open request and stops the engine cleanly. Nothing ever leaves a request waiting.
Start-up values travel in a ready message (`await_ready`), never in shared state.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from actors.pending_reply import PendingReply
from actors.transport import Inbox, Outbox
from engine.codec import DecodeError, InboxDecoder, encode
from engine.errors import describe
from engine.messages import Shutdown

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[None] | None]
M = TypeVar("M")
_ANSWER_DUE = object()  # _recv: the expected answer is in, or past its deadline


class ActorStartupError(RuntimeError):
    """A peer did not announce itself ready in time."""


class Actor:
    """One asyncio loop task over one inbox, dispatching each message to `handlers[type]`.

    Contract:
    - The inbox accepts exactly the handlers' message types plus `Shutdown`; its decoder
      rejects everything else. Handlers may be coroutine functions or plain functions.
    - Messages are handled one at a time, in arrival order; `after_message()` runs after
      each (outside any request's guard).
    - `Shutdown` runs its handler if one is registered, then the loop ends.
    - The failure rule. A message with a `request_id` field concerns that request: if
      its handler raises, the error is logged, counted in `num_errors` and
      `fail_request(request_id, error, message)` ends the request. A handler of a message
      about several requests wraps each one's part in `async with self.guard(rid)`,
      which does the same for that request alone. A frame that does not decode is
      dropped (`num_dropped`), and fails the request it names, if it names one. Any
      other exception (a handler of a message about no single request, `after_message`,
      `fail_request` itself) ends the loop, leaving it in `crash` and `is_alive` False.
    - An answer from a peer arrives on one of the `reply_inboxes`. After sending its
      request, a handler either awaits the answer there itself (no other message is
      handled meanwhile), or registers it with `expect(reply, on_reply)` and returns: the
      loop then waits for that answer beside the inbox and, as soon as it is in, calls
      `on_reply(frame)` (before any inbox frame that is also waiting), then
      `after_message()`. `settle()` handles it at once instead (a handler that must not
      go on before it). At most one answer is expected at a time. If its deadline
      passes first, the loop ends with the reply's timeout error; like an exception in
      `on_reply`, that is about no single request.
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
        self._expected: tuple[PendingReply, Handler] | None = None
        self._next_frame: asyncio.Task | None = None  # the inbox's, while an answer is due

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
                if frame is _ANSWER_DUE:
                    await self.settle()
                else:
                    message = await self._decode(frame)
                    if message is not None:
                        await self._dispatch(message)
                if not self._stopping:
                    await self.after_message()
        except Exception as exc:
            self.crash = exc
            log.error("actor %s crashed", self.name, exc_info=exc)
            raise
        finally:
            self._close_transports()

    async def start(self) -> None:
        """Spawn the loop task on the running event loop."""
        if self._task is not None:
            raise RuntimeError(f"actor {self.name} was already started")
        self._task = asyncio.create_task(self.run(), name=f"actor:{self.name}")
        self._task.add_done_callback(_retrieve_exception)

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

    async def fail_request(self, request_id: str, error: str, message: Any) -> None:
        """Ends request `request_id` with `error` (raised while handling `message`, None
        for a frame that did not decode). Actors that handle requests override it; here
        a request failure is an actor failure."""
        raise RuntimeError(f"actor {self.name} cannot fail request {request_id!r}: {error}")

    async def after_message(self) -> None:
        """Runs after every message, outside any request's guard; no-op here."""

    def expect(self, reply: PendingReply, on_reply: Handler) -> None:
        """The loop handles `reply` with `on_reply(frame)` when it arrives (see the
        contract); raises RuntimeError while another answer is expected."""
        if self._expected is not None:
            raise RuntimeError(f"actor {self.name} already expects an answer")
        self._expected = (reply, on_reply)

    @property
    def expects_reply(self) -> bool:
        """An answer is registered with `expect` and not yet handled."""
        return self._expected is not None

    async def settle(self) -> None:
        """Handles the expected answer now, waiting for it until its deadline (raising its
        timeout error after); returns at once when no answer is expected."""
        if self._expected is None:
            return
        reply, on_reply = self._expected
        self._expected = None
        await _call(on_reply, await reply.frame())

    @contextlib.asynccontextmanager
    async def guard(self, request_id: str, message: Any = None) -> AsyncIterator[None]:
        """An exception inside ends request `request_id` (see the failure rule)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - the failure rule: this request only
            await self._fail(request_id, exc, message)

    async def _fail(self, request_id: str, exc: Exception, message: Any) -> None:
        self.num_errors += 1
        what = type(message).__name__ if message is not None else "a message"
        log.warning(
            "actor %s: handling %s failed request %r", self.name, what, request_id, exc_info=exc
        )
        await self.fail_request(request_id, describe(exc), message)

    async def _recv(self) -> Any:
        """The next frame, `_ANSWER_DUE`, or None when stop() interrupted the wait."""
        self._receiving = True
        try:
            if self._expected is None and self._next_frame is None:
                return await self.inbox.recv()
            return await self._recv_or_answer()
        except asyncio.CancelledError:
            if self._stopping:
                return None
            raise
        finally:
            self._receiving = False

    async def _recv_or_answer(self) -> Any:
        """The inbox's next frame, unless the expected answer is in or overdue first."""
        if self._next_frame is None:
            self._next_frame = asyncio.ensure_future(self.inbox.recv())
        if self._expected is not None:
            reply = self._expected[0]
            if not (reply.arrived or self._next_frame.done()):
                await asyncio.wait(
                    {self._next_frame, reply.task},
                    timeout=reply.seconds_left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            if reply.arrived or not reply.seconds_left or not self._next_frame.done():
                return _ANSWER_DUE
        frame = await self._next_frame
        self._next_frame = None
        return frame

    async def _decode(self, frame: bytes) -> Any | None:
        self.num_received += 1
        self.last_activity = time.monotonic()
        try:
            return self.decoder.decode(frame)
        except DecodeError as exc:
            self.num_dropped += 1
            what = f"{len(frame)}-byte frame" if isinstance(frame, bytes) else "message"
            log.warning("actor %s dropped a %s: %s", self.name, what, exc)
            if exc.request_id is not None:
                error = f"an internal message about this request could not be decoded: {exc}"
                await self.fail_request(exc.request_id, error, None)
            return None

    async def _dispatch(self, message: Any) -> None:
        handler = self.handlers.get(type(message))
        request_id = getattr(message, "request_id", None)
        if handler is not None and isinstance(request_id, str):
            async with self.guard(request_id, message):
                await _call(handler, message)
        elif handler is not None:
            await _call(handler, message)  # about no single request: an error is fatal
        if isinstance(message, Shutdown):
            log.info("actor %s shutting down: %s", self.name, message.reason)
            self._stopping = True

    def _close_transports(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._expected is not None:
            self._expected[0].cancel()
        if self._next_frame is not None:
            self._next_frame.cancel()
        self.inbox.close()
        for inbox in self.reply_inboxes:
            inbox.close()
        for outbox in self.outboxes:
            outbox.close()


def _retrieve_exception(task: asyncio.Task[None]) -> None:
    """The loop logged its crash already (`crash`); asyncio need not warn again."""
    if not task.cancelled():
        task.exception()


async def _call(handler: Handler, message: Any) -> None:
    result = handler(message)
    if inspect.isawaitable(result):
        await result


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
