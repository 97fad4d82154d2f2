"""`ReplicaSet`: N data-parallel engine replicas behind the engine client's interface.

Each replica is a whole `AsyncEngine` (its own actors, worker process and KV cache); a
`ReplicaRouter` (engine/core/replica_router.py) places each request, by prefix affinity
and then load, among the replicas that serve, and the set keeps every request's replica
until its stream ends. Each replica is a `RestartingEngine`: one whose worker dies fails
its own open requests only, is skipped by the router while it restarts (the others
serve: the set is DEGRADED, not down), and takes traffic again once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from actors.engine_status import EngineStatus
from actors.replica_launch import check_num_replicas, launch_replicas
from actors.request_ids import RequestIds, refuse_open
from actors.restarting_engine import RestartingEngine, RestartPolicy
from actors.supervisor import Supervision, WatchStats
from actors.worker_launch import WorkerLaunch
from engine.config import EngineConfig
from engine.core.replica_router import ReplicaRouter, RoutedPrompt
from engine.core.stats import EngineStats, summed_by_position
from engine.engine_args import EngineArgs
from engine.messages import (
    ChatInput,
    ChatPrompt,
    OutputDelta,
    PromptInput,
    TokenizeResult,
    WorkerReady,
)
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaSet:
    """The `EngineClient` over `replicas` (started together with
    `await ReplicaSet.start(args, num_replicas)`; a replica that fails its start fails
    the whole start, and no replica's process is left running).

    `generate` places a request with the router given each replica's load (its open
    requests here), among the replicas that serve, and streams it from that replica;
    `abort` goes to the replica that has the request; `tokenize`, `detokenize` and
    `count_prompt_tokens` go to the first healthy replica (every replica has the same
    tokenizer); `stats()` merges the serving replicas' (a dead one's blocks are not in
    use anywhere) and `watch_stats()` every replica's (counts summed); the set serves
    while any replica does (`status`: OK, DEGRADED, else RESTARTING or UNHEALTHY);
    `shutdown` stops them all at once."""

    def __init__(self, replicas: Sequence[RestartingEngine], router: ReplicaRouter) -> None:
        if len(replicas) != router.num_replicas:
            raise ValueError(f"{len(replicas)} replicas for a router of {router.num_replicas}")
        self.replicas = tuple(replicas)
        self.router = router
        self.loads = [0] * len(replicas)  # open requests per replica
        self._owner: dict[str, int] = {}  # request_id -> its replica, while open
        self._ids = RequestIds()

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        num_replicas: int,
        pipeline_depth: int = 2,
        ready_timeout: float = 300.0,
        supervision: Supervision | None = None,
        config: EngineConfig | None = None,
        launches: Sequence[WorkerLaunch] | None = None,
        router: ReplicaRouter | None = None,
        restart: RestartPolicy | None = None,
    ) -> ReplicaSet:
        """Starts `num_replicas` engines for `args`, concurrently. `launches`: one worker
        per replica launched already (`launch_replicas`), owned by the set from here on;
        `config`: `args.build()`, when the caller has built it; `restart`: how a replica
        whose worker dies comes back (default: it does not)."""
        policy = restart or RestartPolicy(max_restarts=0)
        check_num_replicas(num_replicas)
        if launches is None:
            config = config or await asyncio.to_thread(args.build)
            launches = launch_replicas(args, num_replicas, config.device.device)
        if len(launches) != num_replicas:
            for launch in launches:
                launch.abandon()
            raise ValueError(f"{len(launches)} worker launches for {num_replicas} replicas")
        starts = [
            asyncio.ensure_future(
                RestartingEngine.start(
                    args,
                    policy,
                    pipeline_depth=pipeline_depth,
                    ready_timeout=ready_timeout,
                    supervision=supervision,
                    config=config,
                    launch=launch,
                )
            )
            for launch in launches
        ]
        replicas = await _all_or_none(starts, launches)
        logger.info("%d data-parallel replicas ready", num_replicas)
        return cls(replicas, router or ReplicaRouter(num_replicas))

    @property
    def ready(self) -> WorkerReady:
        """What replica 0's worker found at start-up; the context length and attention
        backend are the same on every replica (same arguments, same kind of device)."""
        return self.replicas[0].ready

    @property
    def status(self) -> EngineStatus:
        return EngineStatus.of_replicas(self.replica_statuses())

    def replica_statuses(self) -> tuple[EngineStatus, ...]:
        return tuple(r.status for r in self.replicas)

    def replica_stats(self) -> tuple[EngineStats, ...]:
        """Each replica's own stats (a dead one's as it left them)."""
        return tuple(r.stats() for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        """Serves: at least one replica does."""
        return any(r.is_healthy for r in self.replicas)

    @property
    def error(self) -> str | None:
        """Why no replica serves (the first one's error, naming it); None while one does."""
        if self.is_healthy:
            return None
        return next(
            (f"replica {i}: {r.error}" for i, r in enumerate(self.replicas) if r.error), None
        )

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving an open request (None once its stream has ended)."""
        return self._owner.get(request_id)

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """The stream of the replica the router picks for `prompt`."""
        request_id = self._ids.claim(request_id, "dp-req")
        refuse_open(request_id, self._owner)
        replica = self._route(prompt)
        self._owner[request_id] = replica
        self.loads[replica] += 1
        try:
            outs = self.replicas[replica].generate(
                prompt, params, request_id, strict_max_tokens=strict_max_tokens
            )
            async with contextlib.aclosing(outs):  # leaving early aborts it there, now
                async for out in outs:
                    yield out
        finally:
            self.loads[replica] -= 1
            del self._owner[request_id]

    def _route(self, prompt: PromptInput) -> int:
        """The router's pick among the healthy replicas; input it cannot read goes to the
        least-loaded healthy replica, whose validation refuses it with an error naming
        the field. RuntimeError when no replica serves."""
        healthy = [r.is_healthy for r in self.replicas]
        if not any(healthy):
            raise RuntimeError(f"no replica serves: {self.error}")
        try:
            return self.router.route(_routed(prompt), self.loads, healthy)
        except (TypeError, ValueError, AttributeError):
            serving = [r for r in range(len(self.replicas)) if healthy[r]]
            return min(serving, key=lambda r: (self.loads[r], r))

    async def abort(self, request_id: str) -> None:
        """Stops an open request on its replica; an unknown id is ignored."""
        replica = self._owner.get(request_id)
        if replica is not None:
            await self.replicas[replica].abort(request_id)

    async def tokenize(
        self,
        prompt: str | ChatInput,
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> TokenizeResult:
        return await self._any().tokenize(
            prompt,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
        )

    async def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool = False
    ) -> TokenizeResult:
        return await self._any().detokenize(token_ids, skip_special_tokens=skip_special_tokens)

    async def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        return await self._any().count_prompt_tokens(messages)

    def _any(self) -> RestartingEngine:
        """The first healthy replica (replica 0 when none is: its error says why)."""
        return next((r for r in self.replicas if r.is_healthy), self.replicas[0])

    def stats(self) -> EngineStats:
        """The serving replicas' stats merged (`EngineStats.merged`; every replica's
        when none serves); each replica's own are in `replicas[i].stats()`."""
        serving = [r for r in self.replicas if r.is_healthy] or self.replicas
        return EngineStats.merged([r.stats() for r in serving])

    def watch_stats(self) -> WatchStats:
        """Counts summed; the oldest request and the most silent worker of any replica."""
        parts = [r.watch_stats() for r in self.replicas]
        return WatchStats(
            sum(p.num_timed_out for p in parts),
            sum(p.num_over_deadline for p in parts),
            max(p.oldest_request_s for p in parts),
            max(p.worker_silent_s for p in parts),
            sum(p.num_restarts for p in parts),
            summed_by_position([p.expert_load for p in parts]),
        )

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops every replica, concurrently; idempotent."""
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))


def _routed(prompt: PromptInput) -> RoutedPrompt:
    """What the router reads: a chat's messages as (role, content) pairs."""
    if isinstance(prompt, ChatPrompt):
        return [(m.role, m.content) for m in prompt.messages]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return [(str(m.get("role")), str(m.get("content"))) for m in prompt]
    return prompt


async def _all_or_none(
    starts: list[asyncio.Future[RestartingEngine]], launches: Sequence[WorkerLaunch]
) -> list[RestartingEngine]:
    """Every start's engine, or, at the first failure (or the caller's cancellation),
    none (`_stop_all`), and the first error raised with a note naming its replica."""
    try:
        await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await _stop_all(starts, launches)
        raise
    failed = [i for i, start in enumerate(starts) if _failed(start)]
    if not failed:
        return [start.result() for start in starts]
    await _stop_all(starts, launches)
    error = starts[failed[0]].exception()
    error.add_note(f"(data-parallel replica {failed[0]} of {len(starts)} failed to start)")
    logger.error("replica %d failed to start; every replica was stopped", failed[0])
    raise error


def _failed(start: asyncio.Future) -> bool:
    return start.done() and (start.cancelled() or start.exception() is not None)


async def _stop_all(
    starts: list[asyncio.Future[RestartingEngine]], launches: Sequence[WorkerLaunch]
) -> None:
    """Kills the workers of the starts still waiting (they fail at once), shuts down
    the engines that started, then abandons every launch (a no-op after a shutdown)."""
    for start, launch in zip(starts, launches, strict=True):
        if not start.done():
            launch.abandon()
    await asyncio.wait(starts)
    started = [start.result() for start in starts if not _failed(start)]
    await asyncio.gather(*(engine.shutdown() for engine in started), return_exceptions=True)
    for launch in launches:
        launch.abandon()
