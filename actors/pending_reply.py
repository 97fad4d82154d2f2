"""One answer an actor awaits on a reply inbox, due by a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from actors.transport import Inbox


class PendingReply:
    """The next frame on a reply inbox, expected within `timeout` seconds.

    Contract: the receive starts at construction (a task), so the answer is taken off the
    inbox as soon as it arrives, whoever waits for it: the actor's loop beside its own
    inbox (`Actor.expect`) or a handler alone (`Actor.settle`). Nothing else may read that
    inbox while the reply is pending. `frame()` returns the answer, or, once the deadline
    has passed without one, cancels the receive and raises `timed_out()`.
    """

    def __init__(self, inbox: Inbox, timeout: float, timed_out: Callable[[], Exception]) -> None:
        self.task: asyncio.Task = asyncio.ensure_future(inbox.recv())
        self.deadline = time.monotonic() + timeout
        self._timed_out = timed_out

    @property
    def arrived(self) -> bool:
        return self.task.done()

    @property
    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def frame(self) -> bytes:
        """The answer (waiting for it until the deadline); raises `timed_out()` after."""
        if not self.task.done():
            await asyncio.wait({self.task}, timeout=self.seconds_left)
        if not self.task.done():
            self.task.cancel()
            raise self._timed_out()
        return self.task.result()

    def cancel(self) -> None:
        """Stops waiting (the actor is closing); an answer not yet taken stays unread."""
        self.task.cancel()
