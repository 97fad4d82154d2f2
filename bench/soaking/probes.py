"""Disconnect probes: after the client leaves, the server must stop decoding."""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time

from .context import Ctx
from .load import run_one
from .outcome import RESULT
from .progress import since
from .watch import scrape

PROBES = ("ws_cancel", "ws_disconnect", "sse_disconnect", "http_abandon")
BUSY_GAUGES = ("pagedserve_num_requests_running", "pagedserve_num_requests_live")
GEN_TOKENS = "pagedserve_generation_tokens_total"
FINISHED_LENGTH = 'pagedserve_requests_total{finish_reason="length"}'
PROBE_RELEASE_S = 1.0  # a request whose client left must be gone from the server by then
PROBE_WAIT_S = 30.0  # how long a probe watches for that


async def probe(ctx: Ctx, kind: str, k: int) -> dict:
    """`k` long requests of `kind` (the client leaves early): the server must drop them
    (running and live requests back to where they were before the probe) within
    PROBE_RELEASE_S, and none may run on to "length"
    (pagedserve_requests_total{finish_reason="length"} unchanged)."""
    before = await scrape(ctx) or {}
    base = [before.get(g, 0) for g in BUSY_GAUGES]
    rngs = [random.Random(f"{ctx.args.seed}:probe:{kind}:{i}") for i in range(k)]
    outcomes = await asyncio.gather(
        *(run_one(ctx, kind, rng, ctx.args.deadline, long=ctx.args.long_tokens) for rng in rngs)
    )
    left, at_left = time.monotonic(), await scrape(ctx) or {}
    released, now = await wait_released(ctx, base, left, at_left)
    ran_to_length = now.get(FINISHED_LENGTH, 0) - before.get(FINISHED_LENGTH, 0)
    result = {
        "kind": kind,
        "requests": k,
        "max_tokens": ctx.args.long_tokens,
        "client": collections.Counter(f"{o.status}: {o.note}" for o in outcomes),
        "baseline": dict(zip(BUSY_GAUGES, base, strict=True)),
        "released_after_s": released,
        "tokens_generated_after_leaving": now.get(GEN_TOKENS, 0) - at_left.get(GEN_TOKENS, 0),
        "ran_to_length": ran_to_length,
    }
    result["passed"] = (
        released is not None and released <= PROBE_RELEASE_S and ran_to_length == 0
    ) and all(o.status == RESULT for o in outcomes)
    return result


async def wait_released(
    ctx: Ctx, base: list[float], left: float, at_left: dict[str, float]
) -> tuple[float | None, dict[str, float]]:
    """Polls /metrics for up to PROBE_WAIT_S after the client `left` (a monotonic time)
    until BUSY_GAUGES are back to `base`: (seconds since `left`, None if never; the last
    metrics seen, `at_left` if none)."""
    now = at_left
    while time.monotonic() - left < PROBE_WAIT_S:
        now = await scrape(ctx) or {}
        if all(now.get(g, math.inf) <= b for g, b in zip(BUSY_GAUGES, base, strict=True)):
            return since(left), now
        await asyncio.sleep(0.05)
    return None, now


def probe_figures(p: dict) -> str:
    """How a probe went, as the summary and the failures quote it."""
    return (
        f"released after {p['released_after_s']} s, "
        f"{p['tokens_generated_after_leaving']:.0f} tokens after leaving, "
        f"{p['ran_to_length']:.0f} ran to length"
    )
