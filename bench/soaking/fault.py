"""The fault phase: long requests streaming when the worker gets SIGKILL; each must end
in an error within FAULT_ANSWER_S. What follows is in restart.py; with --no-restart (a
server that does not replace its worker) it is here: /health must say 503 and new
requests must be refused at once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from .conn import Closed, WsConn, describe, ws_run
from .context import Ctx
from .http_kinds import read_sse
from .messages import http_body, ws_generate_message
from .procs import worker_pid
from .progress import log, since
from .watch import Sampler, scrape

DOCUMENTED_CLOSES = {1001: "going away", 1008: "bad key", 1009: "too big", 4008: "slow reader"}
FAULT_ANSWER_S = 10.0  # every request in flight at the kill must be answered by then
REFUSE_S = 5.0  # a new request after the kill with no answer by then is a hang


@dataclass
class FaultAnswer:
    """How one request in flight at the kill ended: `status` is "error" (as it should),
    "finished" (it ended before the kill) or "unexpected"; `at` is the time.monotonic()
    of the answer."""

    protocol: str
    status: str
    detail: str
    at: float | None = None

    @classmethod
    def now(cls, protocol: str, status: str, detail: str) -> FaultAnswer:
        """An answer that arrived just now."""
        return cls(protocol, status, detail, time.monotonic())


async def fault_ws(
    ctx: Ctx, conn: WsConn, rng: random.Random, started: asyncio.Event
) -> FaultAnswer:
    message = ws_generate_message(ctx, rng, ctx.args.long_tokens)

    async def first(delta: dict) -> None:
        started.set()

    event, _ = await ws_run(conn, message, first)
    at = time.monotonic()
    if isinstance(event, Closed):
        status = "error" if event.code in DOCUMENTED_CLOSES else "unexpected"
        return FaultAnswer("ws", status, describe(event), at)
    if event.get("type") == "error":
        return FaultAnswer("ws", "error", describe(event), at)
    if event.get("finish_reason") in ("stop", "length"):
        return FaultAnswer("ws", "finished", describe(event), at)
    return FaultAnswer("ws", "unexpected", describe(event), at)


async def fault_sse(ctx: Ctx, rng: random.Random, started: asyncio.Event) -> FaultAnswer:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=True, long=ctx.args.long_tokens)
    try:
        async with ctx.http.stream("POST", ctx.completions_url(chat), json=body) as response:
            if response.status_code >= 500:
                return FaultAnswer.now("sse", "error", f"HTTP {response.status_code}")
            if response.status_code != 200:
                return FaultAnswer.now("sse", "unexpected", f"HTTP {response.status_code}")
            started.set()
            state = await read_sse(response)
    except httpx.HTTPError as exc:  # the stream was cut: an end of stream
        return FaultAnswer.now("sse", "error", f"stream cut: {type(exc).__name__}")
    at = time.monotonic()
    if state["error"] is not None:
        return FaultAnswer("sse", "error", f"error chunk: {state['error'].get('message')}", at)
    if state["done"] and state["finished"]:
        return FaultAnswer("sse", "finished", "[DONE] after finish_reason", at)
    if not state["done"]:
        return FaultAnswer("sse", "error", "stream ended without [DONE]", at)
    return FaultAnswer("sse", "unexpected", "[DONE] with neither error nor finish_reason", at)


async def fault_http(ctx: Ctx, rng: random.Random) -> FaultAnswer:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=False, long=ctx.args.long_tokens)
    try:
        response = await ctx.http.post(ctx.completions_url(chat), json=body)
    except httpx.HTTPError as exc:
        return FaultAnswer.now("http", "unexpected", f"{type(exc).__name__}: {exc}")
    at = time.monotonic()
    if response.status_code >= 500:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return FaultAnswer("http", "unexpected", f"HTTP {response.status_code}, no JSON", at)
        return FaultAnswer("http", "error", f"HTTP {response.status_code}: {message[:80]}", at)
    if response.status_code == 200:
        return FaultAnswer("http", "finished", "HTTP 200", at)
    text = response.text[:80]
    return FaultAnswer("http", "unexpected", f"HTTP {response.status_code}: {text}", at)


async def fault_batch(ctx: Ctx, sampler: Sampler, server_pid: int) -> dict:
    """Long requests in flight, then SIGKILL to the worker: each must end in an error
    within FAULT_ANSWER_S."""
    conns = [await WsConn.open(ctx.ws_url, binary=i % 2 == 1) for i in range(2)]
    started, tasks = start_fault_requests(ctx, conns)
    streaming = await wait_streaming(started)
    metrics = await scrape(ctx) or {}
    pid = worker_pid(server_pid)
    if pid is None:
        for task in tasks:
            task.cancel()
        return {"error": "no worker process found"}
    sampler.samples.append(await sampler.sample())  # the batch lasts less than a sample
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    sampler.mark("kill")
    log(f"killed worker {pid} with {streaming} requests streaming")
    answers, hangs = await collect_answers(tasks)
    out = summarize_fault(answers, hangs, killed)
    out |= {
        "worker_pid": pid,
        "streaming_at_kill": streaming,
        "running_at_kill": metrics.get("pagedserve_num_requests_running"),
        "waiting_at_kill": metrics.get("pagedserve_num_requests_waiting"),
    }
    for conn in conns:
        await conn.close()
    return out


def start_fault_requests(
    ctx: Ctx, conns: list[WsConn]
) -> tuple[list[asyncio.Event], list[asyncio.Task]]:
    """Starts --fault-ws WebSocket (over `conns` in turn), --fault-sse SSE and
    --fault-http plain requests, counted in flight until they end: (one event per
    stream, set at its first delta or chunk; the tasks)."""
    a = ctx.args
    rng = random.Random(f"{a.seed}:fault")
    started = [asyncio.Event() for _ in range(a.fault_ws + a.fault_sse)]
    tasks = [
        asyncio.create_task(fault_ws(ctx, conns[i % 2], random.Random(rng.random()), started[i]))
        for i in range(a.fault_ws)
    ]
    tasks += [
        asyncio.create_task(fault_sse(ctx, random.Random(rng.random()), started[a.fault_ws + i]))
        for i in range(a.fault_sse)
    ]
    tasks += [
        asyncio.create_task(fault_http(ctx, random.Random(rng.random())))
        for _ in range(a.fault_http)
    ]
    ctx.in_flight += len(tasks)
    for task in tasks:
        task.add_done_callback(lambda _: setattr(ctx, "in_flight", ctx.in_flight - 1))
    return started, tasks


async def wait_streaming(started: list[asyncio.Event]) -> int:
    """Waits for the first stream's first delta (10 s at most), then for the others (1 s
    at most: with more requests than max_num_seqs some are still waiting); returns how
    many are streaming."""
    waiters = [asyncio.ensure_future(e.wait()) for e in started]
    try:
        await asyncio.wait(waiters, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.wait(waiters, timeout=1)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return sum(e.is_set() for e in started)


async def collect_answers(tasks: list[asyncio.Task]) -> tuple[list[FaultAnswer], int]:
    """The answers within FAULT_ANSWER_S (a task that raised: unexpected), and how many
    hung (those are cancelled)."""
    done, pending = await asyncio.wait(tasks, timeout=FAULT_ANSWER_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if not t.exception() else _crashed(t) for t in done], len(pending)


def _crashed(task: asyncio.Task) -> FaultAnswer:
    exc = task.exception()
    return FaultAnswer.now("?", "unexpected", f"client {type(exc).__name__}: {exc}")


def summarize_fault(answers: list[FaultAnswer], hangs: int, killed: float) -> dict:
    by = collections.Counter(f"{a.protocol} {a.status}: {a.detail[:70]}" for a in answers)
    times = [a.at - killed for a in answers if a.at is not None and a.status != "finished"]
    return {
        "in_flight": len(answers) + hangs,
        "errors": sum(a.status == "error" for a in answers),
        "finished_before_kill": sum(a.status == "finished" for a in answers),
        "unexpected": sum(a.status == "unexpected" for a in answers),
        "hangs": hangs,
        "last_answer_after_s": round(max(times), 3) if times else None,
        "answers": dict(by.most_common()),
    }


# -- after the kill -------------------------------------------------------------------
async def after_kill(ctx: Ctx) -> dict:
    """/health must say 503; new requests of each protocol must be refused promptly;
    /health must still say 503 after them."""
    health = await wait_unhealthy(ctx)
    refusals = {}
    for name, call in (("ws", refuse_ws), ("sse", refuse_sse), ("http", refuse_http)):
        refusals[name] = await refusal(ctx, call)
    later = await wait_unhealthy(ctx)
    return {"health": health, "new_requests": refusals, "health_after_refusals": later}


async def wait_unhealthy(ctx: Ctx) -> dict:
    """Polls /health until it says 503, FAULT_ANSWER_S at most: its last answer."""
    start, health = time.monotonic(), None
    while time.monotonic() - start < FAULT_ANSWER_S:
        with contextlib.suppress(httpx.HTTPError):
            response = await ctx.http.get(ctx.base_url + "/health", timeout=2.0)
            health = {"status": response.status_code, "body": response.text[:200]}
            if response.status_code == 503:
                break
        await asyncio.sleep(0.1)
    return (health or {}) | {"after_s": since(start)}


async def refusal(ctx: Ctx, call: Callable[[Ctx], Awaitable[str]]) -> dict:
    """One new request (`call`): its answer and how long it took."""
    t = time.monotonic()
    try:
        async with asyncio.timeout(REFUSE_S):
            answer = await call(ctx)
    except TimeoutError:
        answer = f"HANG (no answer in {REFUSE_S:g} s)"
    except Exception as exc:  # noqa: BLE001 - recorded
        answer = f"client {type(exc).__name__}: {exc}"
    return {"answer": answer[:200], "after_s": since(t)}


async def refuse_ws(ctx: Ctx) -> str:
    conn = await WsConn.open(ctx.ws_url, binary=False)
    try:
        message = ws_generate_message(ctx, random.Random(0))
        event, _ = await ws_run(conn, message)
        return describe(event)
    finally:
        await conn.close()


async def refuse_sse(ctx: Ctx) -> str:
    body = http_body(ctx, random.Random(0), chat=False, stream=True)
    async with ctx.http.stream("POST", ctx.completions_url(False), json=body) as response:
        text = (await response.aread()).decode(errors="replace")
        return f"HTTP {response.status_code}: {text[:150]}"


async def refuse_http(ctx: Ctx) -> str:
    body = http_body(ctx, random.Random(0), chat=True, stream=False)
    response = await ctx.http.post(ctx.completions_url(True), json=body)
    return f"HTTP {response.status_code}: {response.text[:150]}"


def refused_ok(answer: str) -> bool:
    """A refusal as it should be: an error event or an HTTP 5xx."""
    return answer.startswith("error ") or bool(re.match(r"HTTP 5\d\d", answer))
