"""`Supervisor`: one engine's watch loop, a few times a second.

A worker process that exits or an actor that crashed (the failure rule's "cannot be tied
to one request") loses the engine: every open request ends with an error and the engine
shuts down. A worker silent past `Supervision.worker_timeout_s` (frozen, wedged) makes
the engine unhealthy and fails every open request; when its heartbeats come back, the
engine is healthy again. Under tensor parallelism a silent rank holds the others in
their collectives: it loses the engine. A request older than
`Supervision.request_timeout_s` is ended with a timeout error.

The supervisor decides; the engine acts, through the callbacks it gave the supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from actors.actor import Actor
from actors.worker_monitor import WorkerHealth, WorkerMonitor
from engine.messages import ErrorKind, OutputDelta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchStats:
    """What the supervisor sees (`watch_stats()`): requests ended by the request timeout
    so far, open requests past it now (stuck), the oldest open request's age, the seconds
    since the worker's last heartbeat, and how many times a dead worker was replaced
    (`RestartingEngine`)."""

    num_timed_out: int
    num_over_deadline: int
    oldest_request_s: float
    worker_silent_s: float
    num_restarts: int = 0
    expert_load: tuple[int, ...] = ()  # per expert, from rank 0's heartbeats (MoE models)


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


class Supervisor:
    """Watches one engine by the rules of `supervision` (see the module doc): its workers
    (`monitors`, one per rank of a tensor-parallel group of `world_size`), its `actors`,
    and its open requests (`open_since()`: each one's start, `time.monotonic()`, by
    request id).

    `run()` is the loop; it acts only through the callbacks: `end(request_id, final)`
    ends one request, `fail_open(error)` every open request and call (the engine stays
    up, unhealthy), and `lost(error)` is the engine's end (the loop returns after it).
    `stall_error` says why the engine is unhealthy while a worker is silent (None
    otherwise); `watch_stats()` is what the supervisor sees."""

    def __init__(
        self,
        supervision: Supervision,
        monitors: Sequence[WorkerMonitor],
        actors: Sequence[Actor],
        world_size: int,
        *,
        open_since: Callable[[], Mapping[str, float]],
        end: Callable[[str, OutputDelta], Awaitable[None]],
        fail_open: Callable[[str], Awaitable[None]],
        lost: Callable[[str], Awaitable[None]],
    ) -> None:
        self.supervision = supervision
        self.monitors = tuple(monitors)
        self.actors = tuple(actors)
        self.world_size = world_size
        self._open_since = open_since
        self._end, self._fail_open, self._lost = end, fail_open, lost
        self.stall_error: str | None = None
        self.num_timed_out = 0

    async def run(self) -> None:
        """Every `interval_s`: a lost worker or actor ends the engine (`lost`), else a
        stall is checked and late requests are ended."""
        while True:
            await asyncio.sleep(self.supervision.interval_s)
            health = [monitor.check() for monitor in self.monitors]
            cause = self._loss(health)
            if cause is None:
                silent = max(range(len(health)), key=lambda r: health[r].silent_s)
                if await self._check_stall(silent, health[silent].silent_s):
                    cause = self.stall_error
            if cause is not None:
                break
            await self._expire_requests()
        await self._lost(cause or "the engine stopped")

    def watch_stats(self) -> WatchStats:
        now = time.monotonic()
        ages = [now - started for started in self._open_since().values()]
        limit = self.supervision.request_timeout_s
        return WatchStats(
            self.num_timed_out,
            sum(age > limit for age in ages) if limit is not None else 0,
            max(ages, default=0.0),
            max(monitor.check().silent_s for monitor in self.monitors),
            expert_load=self.monitors[0].expert_load if self.monitors else (),
        )

    def _loss(self, health: list[WorkerHealth]) -> str | None:
        """Why the engine is lost: a worker process exited or an actor stopped."""
        exited = next((r for r, h in enumerate(health) if h.exit_code is not None), None)
        if exited is not None:
            return f"worker process {exited} exited with code {health[exited].exit_code}"
        dead = next((a for a in self.actors if not a.is_alive), None)
        if dead is not None:
            return f"the {dead.name} actor stopped: {dead.crash!r}"
        return None

    async def _check_stall(self, rank: int, silent_s: float) -> bool:
        """A silent worker makes the engine unhealthy and fails every open request; its
        heartbeats coming back make it healthy again. Under tensor parallelism a silent
        rank holds the others in their collectives: True, the group must go down."""
        timeout = self.supervision.worker_timeout_s
        if silent_s > timeout and self.stall_error is None:
            self.stall_error = (
                f"worker {rank} has sent no heartbeat for {silent_s:.1f} s (timeout "
                f"{timeout:g} s: frozen or overloaded); open requests were failed"
            )
            if self.world_size > 1:
                return True
            logger.error("%s (%d requests)", self.stall_error, len(self._open_since()))
            await self._fail_open(self.stall_error)
        elif silent_s <= timeout and self.stall_error is not None:
            self.stall_error = None
            logger.warning("worker %d answers again; the engine is healthy", rank)
        return False

    async def _expire_requests(self) -> None:
        limit = self.supervision.request_timeout_s
        if limit is None:
            return
        now = time.monotonic()
        late = [rid for rid, started in self._open_since().items() if now - started > limit]
        for request_id in late:
            self.num_timed_out += 1
            error = f"the request ran past the server's request timeout of {limit:g} s"
            await self._end(request_id, OutputDelta.failed(request_id, error, ErrorKind.TIMEOUT))
