"""The tokenize flood: clients posting prompts far past the context to /tokenize must be
refused quickly (400, or 503 past the queue) while completions beside them stay fast."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from .context import Ctx
from .stopwatch import count_statuses, latency, timed_completion

FLOOD_BYTES = 900_000  # per /tokenize body, or 1 KiB under --max-message-bytes if less
FLOOD_ANSWER_S = 5.0  # each flood request must be answered by then
FLOOD_REFUSALS = {"400", "503"}
COMPLETION_MEDIAN_S = 1.0  # median of the completions timed during the flood


async def flood_client(ctx: Ctx, body: bytes, until: float) -> list[dict]:
    """Posts `body` to /tokenize again and again until `until` (time.monotonic()):
    each answer's status (an exception's name when none came) and seconds."""
    out = []
    headers = {"content-type": "application/json"}
    while time.monotonic() < until:
        start = time.monotonic()
        try:
            response = await ctx.http.post(
                ctx.base_url + "/tokenize", content=body, headers=headers, timeout=30.0
            )
            status = response.status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        out.append({"status": status, "s": round(time.monotonic() - start, 3)})
    return out


async def tokenize_flood(
    ctx: Ctx, clients: int = 16, seconds: float = 4.0, completions: int = 5
) -> dict:
    """`clients` flood clients for `seconds` while `completions` one-token completions
    run one after another (after a short head start for the flood)."""
    size = min(FLOOD_BYTES, ctx.args.max_message_bytes - 1024)  # a body the server reads
    body = json.dumps({"prompt": "Once upon a time " * (size // 17)}).encode()
    until = time.monotonic() + seconds
    flood = [asyncio.create_task(flood_client(ctx, body, until)) for _ in range(clients)]
    await asyncio.sleep(0.5)
    timed = [await timed_completion(ctx) for _ in range(completions)]
    answers = [a for task in flood for a in await task]
    return {
        "clients": clients,
        "body_bytes": len(body),
        "flood_requests": len(answers),
        "flood_statuses": count_statuses(a["status"] for a in answers),
        "flood_latency": latency([a["s"] for a in answers]),
        "completion_statuses": count_statuses(t["status"] for t in timed),
        "completion_latency": latency([t["s"] for t in timed]),
    }


def flood_failures(f: dict | None) -> list[str]:
    """Every flood request refused (400/503) within FLOOD_ANSWER_S; every completion a
    200, their median under COMPLETION_MEDIAN_S."""
    if f is None:
        return []
    out = []
    if not set(f["flood_statuses"]) <= FLOOD_REFUSALS:
        out.append(f"tokenize flood: answers {f['flood_statuses']}")
    if (f["flood_latency"]["max_s"] or 0) > FLOOD_ANSWER_S:
        out.append(f"tokenize flood: slowest refusal {f['flood_latency']['max_s']} s")
    if set(f["completion_statuses"]) != {"200"}:
        out.append(f"tokenize flood: completions {f['completion_statuses']}")
    median = f["completion_latency"]["median_s"]
    if median is None or median >= COMPLETION_MEDIAN_S:
        out.append(f"tokenize flood: completion median {median} s")
    return out
