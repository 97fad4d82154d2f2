"""Is the worker process alive and answering? Its exit status and its heartbeats tell.

The worker sends a `WorkerHeartbeat` every half second from a thread of its own, so a
long step does not silence it; silence means the process is frozen (SIGSTOP, a debugger),
starved or wedged. The monitor reads heartbeats without waiting, at the moment it is
asked (`check`), from a socket of its own: a busy event loop cannot make it see silence
that is only heartbeats not yet read. With a `FrameAuth`, heartbeats are sealed by the
worker and opened here: a frame that does not open is refused (counted, logged at most
once per reason per 10 s) and is not a sign of life.

A worker on another host (`process` None) has no exit status here, and its clock is not
this host's: its silence counts from when its last heartbeat arrived.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
from dataclasses import dataclass

import zmq

from actors.frame_auth import FrameAuth, FrameRefused, RefusalLog
from actors.transport import peer_address
from engine.codec import DecodeError, InboxDecoder
from engine.messages import INBOXES, WorkerHeartbeat

logger = logging.getLogger(__name__)
_NO_BEAT = WorkerHeartbeat(-1, float("-inf"))  # a frame that was not a heartbeat


@dataclass(frozen=True)
class WorkerHealth:
    """One look at a worker: `exit_code` once its process has exited; `silent_s`, the
    seconds since its last heartbeat was sent."""

    exit_code: int | None
    silent_s: float


class WorkerMonitor:
    """Watches one worker process and the heartbeats it sends to `address` (bound here;
    `endpoint`: where, a wildcard port resolved).

    `check()` drains the heartbeats that arrived and says how the worker is; `close()`
    releases the socket. Times are `time.monotonic()`, one clock for the whole host.
    With `auth`, only heartbeats sealed for `auth.channel` count (`num_refused`: the
    others). `process` None: a worker on another host (see the module doc)."""

    def __init__(
        self, process: subprocess.Popen | None, address: str, auth: FrameAuth | None = None
    ) -> None:
        self.process = process
        self._auth = auth
        self._refusals = RefusalLog(f"heartbeat monitor {address}")
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self.address = address
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = InboxDecoder(INBOXES["heartbeat"])
        self._last = WorkerHeartbeat(-1, time.monotonic())  # start-up counts as heard
        self._closed = False

    def check(self) -> WorkerHealth:
        while not self._closed and (beat := self._next_heartbeat()) is not None:
            if beat is _NO_BEAT:  # refused or undecodable: no sign of life
                continue
            if self.process is None:  # another host's clock: count from the arrival
                beat = dataclasses.replace(beat, sent_at=time.monotonic())
            if beat.sent_at >= self._last.sent_at:
                self._last = beat
        silent = max(0.0, time.monotonic() - self._last.sent_at)
        return WorkerHealth(None if self.process is None else self.process.poll(), silent)

    @property
    def expert_load(self) -> tuple[int, ...]:
        """The latest heartbeat's expert load (see `WorkerHeartbeat`)."""
        return self._last.expert_load

    @property
    def num_refused(self) -> int:
        """Heartbeat frames dropped because they did not open (0 without `auth`)."""
        return self._refusals.count

    def _next_heartbeat(self) -> WorkerHeartbeat | None:
        try:
            frame = self._socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            payload = frame.bytes if self._auth is None else self._auth.open(frame.bytes)
        except FrameRefused as refused:
            self._refusals.note(refused.reason, peer_address(frame))
            return _NO_BEAT
        try:
            return self._decoder.decode(payload)
        except DecodeError as exc:
            logger.warning("dropped a heartbeat frame: %s", exc)
            return _NO_BEAT

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)
            self._ctx.term()
