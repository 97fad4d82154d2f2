"""The periodic stats line a vLLM user knows: throughput, queue and KV cache usage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Reading:
    """What one tick saw: when, the token totals, and the scheduler's queues."""

    at: float
    prompt_tokens: int
    generation_tokens: int
    running: int
    waiting: int
    drafts: int = 0  # speculative decoding's counters so far
    draft_tokens: int = 0
    accepted: tuple[int, ...] = ()  # accepted drafts by position


class StatsLogger:
    """Every `interval_s` (`run()`, the server's lifespan task; tests call `tick()`
    with a clock of their own) logs at INFO one line: "Avg prompt throughput: X
    tokens/s, Avg generation throughput: Y tokens/s, Running: R reqs, Waiting: W reqs,
    KV cache usage: U%, Prefix cache hit rate: H%" (throughputs over the interval; the
    hit rate over all prompts so far, `EngineStats.prefix_cache_hit_rate`). With
    speculative decoding, over the interval: ", Spec decode: mean acceptance length L,
    acceptance rate A%, per position P0, P1, ..." (vLLM's SpecDecoding metrics).

    Only when something happened: tokens were processed in this interval or in the
    one before (the line where throughput falls to zero), or the running / waiting
    counts changed since the last tick. An idle server stays quiet."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        tokens: Callable[[], tuple[int, int]],
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`tokens`: (prompt tokens, generated tokens) counted so far."""
        self.stats, self.tokens, self.interval_s, self.clock = stats, tokens, interval_s, clock
        self._last = self._read(stats())
        self._was_busy = False

    async def run(self) -> None:
        """Ticks every `interval_s` until cancelled; a failing tick is logged, not fatal."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # a stats bug must not stop the server or this loop
                logger.exception("the periodic stats line failed")

    def tick(self) -> str | None:
        """Logs the line if something happened since the last tick; returns it (None
        when quiet)."""
        stats = self.stats()
        now, last = self._read(stats), self._last
        self._last = now
        elapsed = now.at - last.at
        prompt = now.prompt_tokens - last.prompt_tokens
        generated = now.generation_tokens - last.generation_tokens
        busy = bool(prompt or generated)
        moved = (now.running, now.waiting) != (last.running, last.waiting)
        quiet = not (busy or self._was_busy or moved)
        self._was_busy = busy
        if quiet:
            return None
        line = (
            f"Avg prompt throughput: {_rate(prompt, elapsed):.1f} tokens/s, "
            f"Avg generation throughput: {_rate(generated, elapsed):.1f} tokens/s, "
            f"Running: {now.running} reqs, Waiting: {now.waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}%"
        )
        line += _spec_decode(now, last)
        logger.info("%s", line)
        return line

    def _read(self, stats: EngineStats) -> _Reading:
        prompt, generated = self.tokens()
        return _Reading(
            self.clock(),
            prompt,
            generated,
            stats.num_running,
            stats.num_waiting,
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens_per_pos,
        )


def _spec_decode(now: _Reading, last: _Reading) -> str:
    """The interval's speculative decoding, or "" when no sequence verified drafts."""
    drafts = now.drafts - last.drafts
    if drafts <= 0:
        return ""
    per_pos = [n - (last.accepted[i] if i < len(last.accepted) else 0)
               for i, n in enumerate(now.accepted)]  # fmt: skip
    accepted = sum(per_pos)
    rate = accepted / max(1, now.draft_tokens - last.draft_tokens)
    positions = ", ".join(f"{n / drafts:.2f}" for n in per_pos)
    return (
        f", Spec decode: mean acceptance length {1 + accepted / drafts:.2f}, "
        f"acceptance rate {rate * 100:.1f}%, per position {positions}"
    )


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0
