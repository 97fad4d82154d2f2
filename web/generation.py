"""One engine request as the web layer runs it: admission, timing, metrics, errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors.async_engine import AsyncEngine
from engine.messages import ErrorKind, OutputDelta
from engine.sampling_params import SamplingParams
from web.errors import ApiError, invalid
from web.metrics import Metrics
from web.params import field_of

PromptInput = str | list[int] | list[dict]


@dataclass
class Timing:
    """Seconds since the request arrived at the web layer."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    def summary(self) -> dict[str, float | None]:
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.arrival, 6)

        return {"ttft_s": since(self.first_token), "e2e_s": since(self.finished)}


class Admission:
    """Counts requests between admission and their first token (the queue) and refuses
    new ones beyond `max_queued` with `overloaded`."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.queued = 0

    def admit(self) -> None:
        if self.queued >= self.max_queued:
            raise ApiError(
                "overloaded",
                f"server overloaded: {self.queued} requests queued (max_queued_requests="
                f"{self.max_queued}); retry later",
            )
        self.queued += 1

    def leave(self) -> None:
        self.queued -= 1


class Generator:
    """Runs requests on the engine for the web routes (HTTP and WebSocket alike).

    `live` holds the ids of the requests being streamed; after `drain()` starts, new
    requests are refused with `shutting_down`."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, admission: Admission) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admission = admission
        self.live: set[str] = set()
        self.draining = False

    async def drain(self, grace_s: float, poll_s: float = 0.02) -> int:
        """Refuses new requests, gives the live ones `grace_s` seconds to finish, then
        aborts the rest (their streams end with finish_reason "abort"); returns how many
        were aborted."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        aborted = list(self.live)
        for request_id in aborted:
            await self.engine.abort(request_id)
        deadline = time.monotonic() + 2.0  # the streams take their abort deltas
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return len(aborted)

    async def stream(
        self, prompt: PromptInput, params: SamplingParams, request_id: str, timing: Timing
    ) -> AsyncIterator[OutputDelta]:
        """Yields the engine's deltas; raises ApiError for a refused request (validation,
        overload, an unhealthy engine). A request that fails later ends with an error
        delta (`failure()` turns it into an ApiError). Leaving the loop early aborts the
        request."""
        if self.draining:
            raise ApiError("shutting_down", "the server is shutting down; retry elsewhere")
        if not self.engine.is_healthy:
            raise ApiError("unavailable", f"the engine is not healthy: {self.engine.error}")
        try:
            self.admission.admit()
        except ApiError:
            self.metrics.rejected.labels("overloaded").inc()
            raise
        queued = True
        self.live.add(request_id)
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                if out.error_kind is ErrorKind.INVALID:
                    self.metrics.rejected.labels("invalid_request").inc()
                    raise failure(out)  # refused by the tokenizer's validation
                if queued:
                    queued = False
                    self.admission.leave()
                self._observe(out, timing)
                yield out
        finally:
            self.live.discard(request_id)
            if queued:
                self.admission.leave()

    def _observe(self, out: OutputDelta, timing: Timing) -> None:
        now = time.monotonic()
        m = self.metrics
        if out.token_ids:
            if timing.first_token is None:
                timing.first_token = now
                m.ttft.observe(now - timing.arrival)
                m.prompt_tokens.inc(out.num_prompt_tokens)
            elif timing.last_token is not None:
                m.inter_token.observe((now - timing.last_token) / len(out.token_ids))
            timing.last_token = now
            m.generation_tokens.inc(len(out.token_ids))
        if out.finish_reason is not None:
            timing.finished = now
            m.e2e.observe(now - timing.arrival)
            m.requests.labels(out.finish_reason).inc()


def failure(out: OutputDelta) -> ApiError:
    """The ApiError of a request's final error delta."""
    message = out.error or "the request failed"
    if out.error_kind is ErrorKind.INVALID:
        return invalid(message, field_of(message))
    if out.error_kind is ErrorKind.TIMEOUT:
        return ApiError("timeout", message)
    return ApiError("engine_error", message)
