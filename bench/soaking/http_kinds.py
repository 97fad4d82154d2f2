"""The well-formed HTTP request kinds of the mix (SSE streams, plain completions), each
judged as it ends."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from .context import Ctx
from .messages import http_body, oversize_prompt
from .outcome import RESULT, Outcome, expected_error, ok, unexpected


async def read_sse(response: httpx.Response, leave_after_first: bool = False) -> dict:
    """Reads an SSE stream: {"done": saw [DONE], "error": the error chunk or None,
    "finished": choice indices with a finish_reason, "chunks": n, "left": bool}."""
    state: dict[str, Any] = {"done": False, "error": None, "finished": set(), "chunks": 0}
    state["left"] = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            state["done"] = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            state["error"] = chunk["error"]
            continue
        state["chunks"] += 1
        for choice in chunk.get("choices", ()):
            if choice.get("finish_reason") is not None:
                state["finished"].add(choice.get("index"))
        if leave_after_first and not state["finished"]:
            state["left"] = True
            break
    return state


async def not_a_stream(response: httpx.Response) -> Outcome:
    """A stream request answered with another status than 200."""
    return unexpected(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")


async def post_alone(url: str, **request: Any) -> httpx.Response:
    """A POST on a client of its own (not the shared keep-alive pool)."""
    async with httpx.AsyncClient(timeout=None) as client:
        return await client.post(url, **request)


async def sse_stream(ctx: Ctx, rng: random.Random) -> Outcome:
    """An SSE stream read to [DONE]: every choice must finish, no error chunk."""
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=True)
    async with ctx.http.stream("POST", ctx.completions_url(chat), json=body) as response:
        if response.status_code != 200:
            return await not_a_stream(response)
        state = await read_sse(response)
    n = body.get("n", 1)
    if state["error"] is not None:
        return unexpected(f"error chunk: {state['error']}")
    if not state["done"]:
        return unexpected("stream ended without [DONE]")
    if state["finished"] != set(range(n)):
        return unexpected(f"choices finished: {sorted(state['finished'])} of n={n}")
    return ok("chat" if chat else "completions")


async def sse_disconnect(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """An SSE client that leaves after the first chunk."""
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=True, long=long)
    async with ctx.http.stream("POST", ctx.completions_url(chat), json=body) as response:
        if response.status_code != 200:
            return await not_a_stream(response)
        state = await read_sse(response, leave_after_first=True)
    if state["left"]:
        return ok("left after the first chunk")
    if state["error"] is not None:
        return unexpected(f"error chunk: {state['error']}")
    return ok("finished before the disconnect")


def check_completion(response: httpx.Response, n: int) -> Outcome:
    """A plain completion: HTTP 200 with `n` choices, each finished with stop/length."""
    if response.status_code != 200:
        return unexpected(f"HTTP {response.status_code}: {response.text[:200]}")
    choices = response.json().get("choices", [])
    reasons = [c.get("finish_reason") for c in choices]
    if len(choices) != n or any(r not in ("stop", "length") for r in reasons):
        return unexpected(f"{len(choices)} choices (n={n}), finish reasons {reasons}")
    return ok("n=2" if n == 2 else "n=1")


async def http_plain(ctx: Ctx, rng: random.Random) -> Outcome:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=False)
    response = await ctx.http.post(ctx.completions_url(chat), json=body)
    return check_completion(response, body.get("n", 1))


async def http_abandon(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """A non-streaming client that gives up mid-request (its connection closes)."""
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=False, long=long)
    give_up = rng.uniform(0.05, 0.5) if long is True else 0.3
    try:
        async with asyncio.timeout(give_up):
            response = await ctx.http.post(ctx.completions_url(chat), json=body)
    except TimeoutError:
        return ok("gave up")
    outcome = check_completion(response, body.get("n", 1))
    return ok("answered before the give-up") if outcome.status == RESULT else outcome


async def http_oversize(ctx: Ctx, rng: random.Random) -> Outcome:
    """A body over --max-message-bytes: HTTP 400."""
    body = {"prompt": oversize_prompt(ctx, rng)}
    response = await post_alone(ctx.completions_url(chat=False), json=body)
    if response.status_code == 400:
        return expected_error("HTTP 400")
    return unexpected(f"HTTP {response.status_code}: {response.text[:200]}")
