"""After the worker's SIGKILL on a server that restarts it: /health goes `restarting`
(or straight back to `ok` when the restart is quick), then `ok` again, the restart
counter says 1, and a new request is served."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from .context import Ctx
from .stopwatch import timed_completion
from .watch import scrape

RESTART_OK_S = 60.0  # /health must be 200 `ok` again this long after the kill
UNHEALTHY_GRACE_S = 1.0  # a 503 `unhealthy` is accepted this long after the kill only
RESTARTS = "pagedserve_num_worker_restarts_total"


async def health(ctx: Ctx) -> tuple[int | None, str | None]:
    """/health's (HTTP status, JSON "status"); (None, None): no answer within 2 s."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = await ctx.http.get(ctx.base_url + "/health", timeout=2.0)
        return response.status_code, response.json().get("status")
    return None, None


async def watch_health(ctx: Ctx, since: float, until_ok: float) -> dict:
    """Polls /health every 50 ms until it is 200 `ok` (after at least one other answer,
    or 1 s) or `until_ok` s pass: the statuses seen in order (repeats dropped), each
    with when it was first seen, and when /health was `ok` again (s after `since`)."""
    seen: list[str] = []
    first_seen: list[float] = []
    while time.monotonic() - since < until_ok:
        code, status = await health(ctx)
        label = f"{code} {status}"
        if not seen or seen[-1] != label:
            seen.append(label)
            first_seen.append(round(time.monotonic() - since, 3))
        if label == "200 ok" and (len(seen) > 1 or time.monotonic() - since > 1.0):
            ok = round(time.monotonic() - since, 3)
            return {"seen": seen, "seen_after_s": first_seen, "ok_after_s": ok}
        await asyncio.sleep(0.05)
    return {"seen": seen, "seen_after_s": first_seen, "ok_after_s": None}


async def after_restart(ctx: Ctx, killed: float) -> dict:
    """/health until `ok` again (RESTART_OK_S at most), the restart counter, and one new
    request."""
    watched = await watch_health(ctx, killed, RESTART_OK_S)
    metrics = await scrape(ctx) or {}
    served = await timed_completion(ctx, max_tokens=4)
    return watched | {"restarts": metrics.get(RESTARTS), "new_request": served}


def restart_failures(r: dict) -> list[str]:
    """`restarting` or an immediate `ok` (`unhealthy` only within UNHEALTHY_GRACE_S of
    the kill, before the replacement starts), `ok` within RESTART_OK_S, the counter at
    1, the new request a 200."""
    out = []
    for label, at in zip(r["seen"], r["seen_after_s"], strict=True):
        early = label == "503 unhealthy" and at <= UNHEALTHY_GRACE_S
        if label not in ("503 restarting", "200 ok") and not early:
            out.append(f"fault phase: /health said {label} {at} s after the kill")
    if r["ok_after_s"] is None:
        out.append(f"fault phase: /health not `ok` within {RESTART_OK_S:g} s of the kill")
    if r["restarts"] != 1:
        out.append(f"fault phase: {RESTARTS} is {r['restarts']}, not 1")
    if r["new_request"]["status"] != 200:
        out.append(f"fault phase: new request after the restart: {r['new_request']}")
    return out
