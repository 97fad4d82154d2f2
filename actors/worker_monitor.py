"""Is the worker process alive and answering? Its exit status and its heartbeats tell.

The worker sends a `WorkerHeartbeat` every half second from a thread of its own, so a
long step does not silence it; silence means the process is frozen (SIGSTOP, a debugger),
starved or wedged. The monitor reads heartbeats without waiting, at the moment it is
asked (`check`), from a socket of its own: a busy event loop cannot make it see silence
that is only heartbeats not yet read.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass

import zmq

from engine.codec import DecodeError, InboxDecoder
from engine.messages import INBOXES, WorkerHeartbeat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerHealth:
    """One look at a worker: `exit_code` once its process has exited; `silent_s`, the
    seconds since its last heartbeat was sent."""

    exit_code: int | None
    silent_s: float


class WorkerMonitor:
    """Watches one worker process and the heartbeats it sends to `address` (bound here).

    `check()` drains the heartbeats that arrived and says how the worker is; `close()`
    releases the socket. Times are `time.monotonic()`, one clock for the whole host."""

    def __init__(self, process: subprocess.Popen, address: str) -> None:
        self.process = process
        self.address = address
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._decoder = InboxDecoder(INBOXES["heartbeat"])
        self._last = WorkerHeartbeat(-1, time.monotonic())  # start-up counts as heard
        self._closed = False

    def check(self) -> WorkerHealth:
        while not self._closed and (beat := self._next_heartbeat()) is not None:
            if beat.sent_at >= self._last.sent_at:
                self._last = beat
        silent = max(0.0, time.monotonic() - self._last.sent_at)
        return WorkerHealth(self.process.poll(), silent)

    def _next_heartbeat(self) -> WorkerHeartbeat | None:
        try:
            frame = self._socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return self._decoder.decode(frame)
        except DecodeError as exc:
            logger.warning("dropped a heartbeat frame: %s", exc)
            return self._last

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)
            self._ctx.term()
