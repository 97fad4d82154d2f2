"""`RestartingEngine`: one engine that comes back after its worker dies.

An `AsyncEngine` whose worker process exits (or whose actor crashes) fails its open
requests and shuts itself down for good. Wrapped in a `RestartingEngine`, the engine
client web/ talks to stays: the dead engine is replaced by a fresh one (a new worker
process, new actors, an empty KV cache), after a backoff, up to `RestartPolicy.
max_restarts` attempts in a row. A worker that stays silent (stalled) for
`stall_restart_s` is treated as dead: it is killed and replaced.

While the replacement starts, `status` is RESTARTING: new requests, tokenize calls and
session turns are refused as unavailable (HTTP 503, which the SDK retries); requests
that were in flight on the dead engine ended with its error. Once the attempts are
spent the status is UNHEALTHY, as an engine without restarts is after its worker dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from actors.async_engine import AsyncEngine
from actors.engine_status import EngineStatus
from actors.supervisor import WatchStats
from actors.worker_launch import WorkerLaunch
from engine.core.stats import EngineStats
from engine.engine_args import EngineArgs
from engine.messages import ChatInput, OutputDelta, PromptInput, TokenizeResult, WorkerReady
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """`max_restarts` attempts in a row (0: never restart); attempt k waits
    `backoff_s * 2**(k-1)`, at most `max_backoff_s`; an engine that has served for
    `reset_after_s` resets the count; a worker silent for `stall_restart_s` is
    replaced."""

    max_restarts: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0
    stall_restart_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_restarts}")

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class RestartingEngine:
    """An `EngineClient` over an `AsyncEngine` that `start()` replaces whenever it dies
    (see the module docstring): each call goes to the current one, `engine`; new
    requests and tokenize calls are refused (RuntimeError) while a replacement starts.
    `num_restarts` counts replacements that came up."""

    def __init__(
        self,
        engine: AsyncEngine,
        start: Callable[[], Awaitable[AsyncEngine]],
        policy: RestartPolicy,
    ) -> None:
        self.engine = engine
        self._start = start
        self.policy = policy
        self.num_restarts = 0
        self._attempts = 0  # in a row, since the last engine that served long enough
        self._restarting: str | None = None  # why, while a replacement starts
        self._closing = False
        self._watcher = asyncio.create_task(self._watch(), name="restarts")

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        policy: RestartPolicy,
        launch: WorkerLaunch | None = None,
        **start_kwargs: Any,
    ) -> RestartingEngine:
        """`AsyncEngine.start(args, launch=launch, **start_kwargs)`, wrapped: each
        replacement is started the same way, on `launch.relaunch()` (the same workers'
        environment). Workers with ranks on other hosts cannot be relaunched from here:
        their engine gets no restarts (logged)."""
        launch = launch or WorkerLaunch.start(args)
        engine = await AsyncEngine.start(args, launch=launch, **start_kwargs)
        if not launch.can_relaunch and policy.max_restarts:
            logger.warning("ranks on other hosts: a dead worker will not be restarted")
            policy = dataclasses.replace(policy, max_restarts=0)

        async def restart() -> AsyncEngine:
            return await AsyncEngine.start(args, launch=launch.relaunch(), **start_kwargs)

        return cls(engine, restart, policy)

    @property
    def ready(self) -> WorkerReady:
        return self.engine.ready

    @property
    def status(self) -> EngineStatus:
        if self._restarting is not None:
            return EngineStatus.RESTARTING
        return EngineStatus.OK if self.engine.is_healthy else EngineStatus.UNHEALTHY

    @property
    def is_healthy(self) -> bool:
        return self._restarting is None and self.engine.is_healthy

    @property
    def error(self) -> str | None:
        if self._restarting is not None:
            return f"the worker is restarting after: {self._restarting}"
        return self.engine.error

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """RuntimeError at the first output while the engine is being replaced."""
        self._check_up()
        outs = self.engine.generate(prompt, params, request_id, strict_max_tokens=strict_max_tokens)
        async with contextlib.aclosing(outs):
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def tokenize(
        self,
        prompt: str | ChatInput,
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> TokenizeResult:
        self._check_up()
        return await self.engine.tokenize(
            prompt,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
        )

    async def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool = False
    ) -> TokenizeResult:
        self._check_up()
        return await self.engine.detokenize(token_ids, skip_special_tokens=skip_special_tokens)

    async def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        self._check_up()
        return await self.engine.count_prompt_tokens(messages)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def watch_stats(self) -> WatchStats:
        return dataclasses.replace(self.engine.watch_stats(), num_restarts=self.num_restarts)

    def replica_statuses(self) -> tuple[EngineStatus, ...]:
        return (self.status,)

    def replica_stats(self) -> tuple[EngineStats, ...]:
        return (self.engine.stats(),)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the current engine and any restart under way; idempotent."""
        self._closing = True
        if self._watcher is not asyncio.current_task():
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.engine.shutdown(timeout)

    def _check_up(self) -> None:
        if self._restarting is not None:
            raise RuntimeError(self.error)

    async def _watch(self) -> None:
        """Waits for the current engine to die or stall, then replaces it."""
        while not self._closing:
            started = time.monotonic()
            cause = await self._death_of(self.engine)
            if self._closing:
                return
            if time.monotonic() - started >= self.policy.reset_after_s:
                self._attempts = 0
            if not await self._replace(cause):
                return

    async def _death_of(self, engine: AsyncEngine) -> str:
        """Returns once `engine` has shut down after a failure, or its worker has been
        silent for `stall_restart_s` (it is shut down then): why."""
        while not engine.ended.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(engine.ended.wait(), 0.2)
            silent = engine.watch_stats().worker_silent_s
            if silent >= self.policy.stall_restart_s and not engine.ended.is_set():
                cause = f"the worker sent no heartbeat for {silent:.0f} s"
                await engine.fail(f"{cause}; it was stopped to be replaced")
                return cause
        return engine.error or "the engine stopped"

    async def _replace(self, cause: str) -> bool:
        """Starts engines until one comes up (True) or the attempts are spent (False)."""
        while self._attempts < self.policy.max_restarts:
            self._attempts += 1
            self._restarting = cause
            delay = self.policy.backoff(self._attempts)
            logger.warning(
                "restarting the engine (attempt %d of %d, in %.1f s) after: %s",
                self._attempts,
                self.policy.max_restarts,
                delay,
                cause,
            )
            await asyncio.sleep(delay)
            try:
                self.engine = await self._start()
            except Exception as exc:  # noqa: BLE001 - logged; the next attempt follows
                cause = f"a restart failed: {exc}"
                logger.error("%s", cause)
                continue
            self.num_restarts += 1
            self._restarting = None
            logger.warning("the engine is back (restart %d)", self.num_restarts)
            return True
        self._restarting = None
        if self.policy.max_restarts:
            logger.error("%d restarts in a row failed; the engine stays down", self._attempts)
        return False
