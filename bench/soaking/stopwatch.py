"""Timed plain requests beside a fault, and the latency figures the report keeps."""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Iterable

import httpx

from .context import Ctx


async def timed_completion(ctx: Ctx, max_tokens: int = 1, timeout: float = 30.0) -> dict:
    """One non-streaming /v1/completions request: {"status": HTTP status (None: no
    answer), "s": seconds, "start": its time.monotonic()}."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0}
    start = time.monotonic()
    try:
        response = await ctx.http.post(ctx.completions_url(False), json=body, timeout=timeout)
        status = response.status_code
    except httpx.HTTPError:
        status = None
    return {"status": status, "s": round(time.monotonic() - start, 3), "start": start}


def latency(seconds: list[float]) -> dict:
    """{"n", "max_s", "median_s"} of `seconds` (None when empty)."""
    if not seconds:
        return {"n": 0, "max_s": None, "median_s": None}
    return {
        "n": len(seconds),
        "max_s": round(max(seconds), 3),
        "median_s": round(statistics.median(seconds), 3),
    }


def count_statuses(statuses: Iterable[int | str | None]) -> dict[str, int]:
    """HTTP status (as a string; "None": no answer) -> how many."""
    return dict(collections.Counter(str(s) for s in statuses))
