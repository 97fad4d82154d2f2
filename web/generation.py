"""One engine request as the web layer runs it: admission, timing, metrics, errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors.engine_client import EngineClient
from engine.messages import ErrorKind, OutputDelta, PromptInput
from engine.sampling_params import SamplingParams
from web.client_concurrency import ClientConcurrency
from web.errors import ApiError, invalid
from web.metrics import FinishReason, Metrics
from web.params import field_of


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
    requests are refused with `shutting_down`. `concurrency` counts each client's open
    requests for the routes, which know who the client is (per client request, however
    many engine requests it makes)."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: Metrics,
        admission: Admission,
        concurrency: ClientConcurrency | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admission = admission
        self.concurrency = concurrency or ClientConcurrency()
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
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        timing: Timing,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """Yields the engine's deltas; raises ApiError for a refused request (validation,
        overload, an unhealthy engine). A request that fails later ends with an error
        delta (`failure()` turns it into an ApiError). Leaving the loop early aborts the
        request (its open sequences are counted as aborted). `strict_max_tokens`: see
        GenerateRequest."""
        if self.draining:
            raise ApiError("shutting_down", "the server is shutting down; retry elsewhere")
        if not self.engine.is_healthy:
            raise ApiError("unavailable", f"the engine is not healthy: {self.engine.error}")
        self.admission.admit()
        queued = True
        ends = SequenceEnds(params.n)
        self.live.add(request_id)
        try:
            outs = self.engine.generate(
                prompt, params, request_id, strict_max_tokens=strict_max_tokens
            )
            async for out in _unavailable_until_first(outs):
                if out.error_kind is ErrorKind.INVALID:
                    ends.open.clear()  # a refusal: counted where it is answered
                    raise failure(out)  # refused by the tokenizer's validation
                if queued:
                    queued = False
                    self.admission.leave()
                self._observe(out, timing, ends)
                yield out
        finally:
            self.live.discard(request_id)
            if queued:
                self.admission.leave()
            e2e = time.monotonic() - timing.arrival
            for prompt_tokens, output_tokens in ends.abandon():  # the client left first
                self.metrics.finished(FinishReason.ABORT, e2e, prompt_tokens, output_tokens)

    def _observe(self, out: OutputDelta, timing: Timing, ends: SequenceEnds) -> None:
        now = time.monotonic()
        m = self.metrics
        if out.token_ids:
            gap = None if timing.last_token is None else now - timing.last_token
            if timing.first_token is None:
                timing.first_token = now
                m.first_token(now - timing.arrival, out.num_prompt_tokens)
            timing.last_token = now
            m.generated(len(out.token_ids), gap)
        if out.finish_reason is not None:
            timing.finished = now
        for prompt_tokens, output_tokens in ends.seen(out):
            m.finished(FinishReason.of(out), now - timing.arrival, prompt_tokens, output_tokens)


class SequenceEnds:
    """The sequences of one request (indices 0..n-1) still open, with the latest token
    counts seen: each ends exactly once, by its own final delta, by a request-wide one
    (index -1: abort, error), or by `abandon()` when the client leaves first."""

    def __init__(self, n: int) -> None:
        self.open = set(range(n))
        self.num_prompt_tokens = 0
        self.num_output_tokens: dict[int, int] = {}

    def seen(self, out: OutputDelta) -> list[tuple[int, int]]:
        """(prompt tokens, output tokens) of each sequence `out` ends."""
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        if out.num_output_tokens:
            self.num_output_tokens[out.index] = out.num_output_tokens
        if out.finish_reason is None:
            return []
        if out.index < 0:
            return self.abandon()
        if out.index not in self.open:
            return []
        self.open.discard(out.index)
        return [self._counts(out.index)]

    def abandon(self) -> list[tuple[int, int]]:
        """Ends every open sequence: (prompt tokens, output tokens) of each."""
        ended = [self._counts(index) for index in sorted(self.open)]
        self.open.clear()
        return ended

    def _counts(self, index: int) -> tuple[int, int]:
        return self.num_prompt_tokens, self.num_output_tokens.get(index, 0)


def failure(out: OutputDelta) -> ApiError:
    """The ApiError of a request's final error delta."""
    message = out.error or "the request failed"
    if out.error_kind is ErrorKind.INVALID:
        return invalid(message, field_of(message))
    if out.error_kind is ErrorKind.TIMEOUT:
        return ApiError("timeout", message)
    return ApiError("engine_error", message)


async def _unavailable_until_first(outs: AsyncIterator[OutputDelta]) -> AsyncIterator[OutputDelta]:
    """`outs`, with the engine's refusal to take the request at all (RuntimeError before
    any output: it is down, restarting, or no replica serves) as a 503 the client may
    retry, rather than an internal error."""
    async with contextlib.aclosing(outs):
        try:
            out = await anext(outs)
        except StopAsyncIteration:
            return
        except RuntimeError as exc:
            raise ApiError("unavailable", f"the engine cannot take requests: {exc}") from None
        yield out
        async for out in outs:
            yield out
