"""The well-formed WebSocket request kinds of the mix, each judged as it ends."""

from __future__ import annotations

import random

from .conn import ALL, Closed, WsConn, cancel_message, describe, next_answer, quietly, ws_run
from .context import Ctx
from .messages import SYSTEMS, oversize_prompt, turn_message, ws_generate_message
from .outcome import RESULT, Outcome, expected_error, ok, unexpected


def check_done(event: dict | Closed, deltas: list[dict], max_tokens: int) -> Outcome:
    """A generate that must complete: `done` with stop/length, as many tokens in the
    deltas as its usage says, and no more than max_tokens."""
    if isinstance(event, Closed) or event.get("type") != "done":
        return unexpected(describe(event))
    if event.get("finish_reason") not in ("stop", "length"):
        return unexpected(describe(event))
    got = sum(len(d.get("token_ids", ())) for d in deltas)
    usage = (event.get("usage") or {}).get("completion_tokens")
    if usage != got or got > max_tokens:
        return unexpected(f"deltas carried {got} tokens, usage says {usage}, max {max_tokens}")
    return ok(event["finish_reason"])


async def ws_generate(ctx: Ctx, rng: random.Random, binary: bool) -> Outcome:
    conn = await ctx.pools[binary].get()
    message = ws_generate_message(ctx, rng)
    event, deltas = await ws_run(conn, message)
    return check_done(event, deltas, message["params"]["max_tokens"])


async def ws_json(ctx: Ctx, rng: random.Random) -> Outcome:
    return await ws_generate(ctx, rng, binary=False)


async def ws_msgpack(ctx: Ctx, rng: random.Random) -> Outcome:
    return await ws_generate(ctx, rng, binary=True)


async def ws_cancel(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """Cancel after the first delta: the stream must end with `done`, "abort"."""
    conn = await ctx.pools[rng.random() < 0.5].get()
    message = ws_generate_message(ctx, rng, long)
    sent = False

    async def cancel(delta: dict) -> None:
        nonlocal sent
        if not sent:
            sent = True
            await conn.send(cancel_message(message["id"]))

    event, _ = await ws_run(conn, message, cancel)
    if isinstance(event, dict) and event.get("type") == "done":
        if event.get("finish_reason") == "abort":
            return ok("aborted")
        if event.get("finish_reason") in ("stop", "length"):
            return ok("finished before the cancel")
    return unexpected(describe(event))


async def ws_disconnect(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """Close the socket after the first delta (a connection of its own)."""
    conn = await WsConn.open(ctx.ws_url, binary=rng.random() < 0.3)
    try:
        message = ws_generate_message(ctx, rng, long)
        queue = conn.subscribe(message["id"])
        await conn.send(message)
        first = await queue.get()
        if isinstance(first, dict) and first.get("type") == "delta":
            await conn.close()
            return ok(f"closed after the first delta ({conn.closed.code if conn.closed else '?'})")
        if isinstance(first, dict) and first.get("type") == "done":
            return ok("finished before the disconnect")
        return unexpected(describe(first))
    finally:
        await conn.close()


async def ws_session(ctx: Ctx, rng: random.Random) -> Outcome:
    """session.open, 2..4 turns, session.close, then a turn on the closed session (it
    must be refused with not_found)."""
    conn = await ctx.pools[False].get()
    sid = f"soak-{ctx.new_id()}-{rng.randrange(1 << 30)}"
    refused = await open_session(conn, sid, rng.choice(SYSTEMS))
    if refused is not None:
        return refused
    turns, closed = rng.randint(2, 4), False
    try:
        for turn in range(turns):
            outcome = await session_turn(ctx, rng, conn, sid)
            if outcome.status != RESULT:
                return Outcome(outcome.status, f"turn {turn + 1}: {outcome.note}")
        await conn.send({"type": "session.close", "session_id": sid})
        closed = True
    finally:
        if not closed and conn.closed is None:  # a client closes what it opened
            await quietly(conn.send({"type": "session.close", "session_id": sid}))
    event, _ = await ws_run(conn, turn_message(ctx, rng, sid))
    if isinstance(event, dict) and event.get("type") == "error":
        if event.get("code") == "not_found":
            return ok(f"{turns} turns, closed")
    return unexpected(f"a turn after session.close got {describe(event)}")


async def open_session(conn: WsConn, sid: str, system: str) -> Outcome | None:
    """session.open; None when the server answers with its `session` event."""
    queue = conn.subscribe(sid)
    try:
        await conn.send({"type": "session.open", "session_id": sid, "system": system})
        opened = await next_answer(queue)
        if isinstance(opened, Closed) or opened.get("type") != "session":
            return unexpected(f"session.open: {describe(opened)}")
        return None
    finally:
        conn.unsubscribe(sid)


async def session_turn(ctx: Ctx, rng: random.Random, conn: WsConn, sid: str) -> Outcome:
    message = turn_message(ctx, rng, sid)
    event, deltas = await ws_run(conn, message)
    outcome = check_done(event, deltas, message["params"]["max_tokens"])
    if outcome.status == RESULT and event.get("session_id") != sid:
        return unexpected(f"done carries session_id {event.get('session_id')!r}")
    return outcome


async def ws_oversize(ctx: Ctx, rng: random.Random) -> Outcome:
    """A frame over --max-message-bytes: the server must close with 1009."""
    binary = rng.random() < 0.5
    conn = await WsConn.open(ctx.ws_url, binary, catch_all=True)
    try:
        queue = conn.subscribe(ALL)
        await conn.send({"type": "generate", "id": "big", "prompt": oversize_prompt(ctx, rng)})
        answer = await next_answer(queue)
        if isinstance(answer, Closed) and answer.code == 1009:
            return expected_error("closed 1009")
        return unexpected(describe(answer))
    finally:
        await conn.close()
