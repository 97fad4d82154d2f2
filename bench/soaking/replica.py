"""The replica kill: a second server with two data-parallel replicas under a steady
stream of requests; one replica's worker gets SIGKILL. The router must skip it at once
(no request started after the death is seen may fail), /health must stay 200
`degraded`, and the replica must come back (`ok`, its gauge at 1) and serve again."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from typing import IO

import httpx

from web.launch import ServerProcess

from .context import Ctx
from .procs import descendants
from .progress import log
from .restart import health
from .server import server_args
from .stopwatch import count_statuses, latency, timed_completion
from .watch import scrape

STREAM_CONCURRENCY = 8
STREAM_TOKENS = 16
BEFORE_KILL_S = 3.0  # steady stream before the kill
AFTER_OK_S = 2.0  # steady stream after /health is `ok` again
REPLICA_BACK_S = 60.0  # the replica must be back this long after the kill
BURST = 16  # concurrent requests once it is back
HEALTHY = "pagedserve_replica_healthy"


async def replica_kill(a: argparse.Namespace, env: dict[str, str], log_file: IO[bytes]) -> dict:
    """Starts the two-replica server, runs the phase against it, stops it."""
    server = ServerProcess(server_args(a, data_parallel=2, restart=True), env=env, log=log_file)
    log(f"replica kill: starting {server.url} with --data-parallel-size 2")
    server.start(timeout=300)
    try:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits) as http:
            return await kill_one_replica(Ctx.open(a, server.url, http), server.proc.pid)
    finally:
        server.stop()


def replica_workers(server_pid: int) -> list[int]:
    """The worker processes below the server, oldest (lowest pid) first."""
    found = descendants(server_pid).items()
    return sorted(pid for pid, cmd in found if "actors.worker_actor" in cmd)


async def kill_one_replica(ctx: Ctx, server_pid: int) -> dict:
    """The steady stream, the kill of the newest worker, the health watch until the
    replica is back, then a burst."""
    workers = replica_workers(server_pid)
    if len(workers) != 2:
        return {"error": f"expected 2 workers, found {workers}"}
    stop = asyncio.Event()
    results: list[dict] = []
    stream = [asyncio.create_task(steady(ctx, stop, results)) for _ in range(STREAM_CONCURRENCY)]
    await asyncio.sleep(BEFORE_KILL_S)
    os.kill(workers[-1], signal.SIGKILL)
    killed = time.monotonic()
    log(f"replica kill: killed worker {workers[-1]} with {len(stream)} clients streaming")
    watched = await watch_replicas(ctx, killed)
    await asyncio.sleep(AFTER_OK_S)
    stop.set()
    await asyncio.gather(*stream)
    burst = await asyncio.gather(*(timed_completion(ctx, 4) for _ in range(BURST)))
    return judge_stream(results, killed, watched) | {
        "worker_pid": workers[-1],
        "burst_after_back": count_statuses(b["status"] for b in burst),
    }


async def steady(ctx: Ctx, stop: asyncio.Event, results: list[dict]) -> None:
    """One client: completions back to back until `stop`, each recorded with its end."""
    while not stop.is_set():
        r = await timed_completion(ctx, STREAM_TOKENS)
        results.append(r | {"end": time.monotonic()})


async def watch_replicas(ctx: Ctx, killed: float) -> dict:
    """Polls /health and the replica gauges until /health is `ok` again with every
    replica at 1 after having been otherwise (REPLICA_BACK_S at most): the first
    sign of the death (s after the kill), the statuses seen, when it was back."""
    seen: list[str] = []
    death_seen = back = None
    down: set[str] = set()
    while time.monotonic() - killed < REPLICA_BACK_S:
        code, status = await health(ctx)
        metrics = await scrape(ctx) or {}
        gauges = {k: v for k, v in metrics.items() if k.startswith(HEALTHY + "{")}
        down |= {k for k, v in gauges.items() if v == 0}
        label = f"{code} {status}"
        if not seen or seen[-1] != label:
            seen.append(label)
        sick = label != "200 ok" or any(v == 0 for v in gauges.values())
        if sick and death_seen is None:
            death_seen = time.monotonic()
        if death_seen is not None and not sick and gauges:
            back = time.monotonic()
            break
        await asyncio.sleep(0.05)
    return {
        "death_seen": death_seen,
        "death_seen_after_s": _after(death_seen, killed),
        "health_seen": seen,
        "replicas_down": sorted(down),
        "back_after_s": _after(back, killed),
    }


def judge_stream(results: list[dict], killed: float, watched: dict) -> dict:
    """The stream's figures: failures before and after the death was seen, and how many
    requests were in flight between the kill and the moment it was seen."""
    death = watched.pop("death_seen") or killed
    failed = [r for r in results if r["status"] != 200]
    return watched | {
        "requests": len(results),
        "statuses": count_statuses(r["status"] for r in results),
        "failed_started_after_death": sum(r["start"] >= death for r in failed),
        "failed_started_before_death": sum(r["start"] < death for r in failed),
        "in_flight_at_death": sum(r["start"] < death and r["end"] >= killed for r in results),
        "failed_latency": latency([r["end"] - killed for r in failed]),
        "latency": latency([r["s"] for r in results]),
    }


def replica_failures(r: dict | None) -> list[str]:
    """No failure among requests started after the death was seen, at most the ones in
    flight then; /health 200 `degraded` (never a 503) until back `ok` within
    REPLICA_BACK_S; the burst afterwards all 200."""
    if r is None:
        return []
    if "error" in r:
        return [f"replica kill: {r['error']}"]
    out = []
    if r["failed_started_after_death"]:
        out.append(
            f"replica kill: {r['failed_started_after_death']} request(s) started "
            "after the death was seen failed"
        )
    if r["failed_started_before_death"] > r["in_flight_at_death"]:
        out.append(
            f"replica kill: {r['failed_started_before_death']} failed, more than the "
            f"{r['in_flight_at_death']} in flight"
        )
    if not set(r["health_seen"]) <= {"200 ok", "200 degraded"} or (
        "200 degraded" not in r["health_seen"]
    ):
        out.append(f"replica kill: /health said {r['health_seen']}")
    if r["back_after_s"] is None:
        out.append(f"replica kill: not back within {REPLICA_BACK_S:g} s")
    if r["burst_after_back"] != {"200": BURST}:
        out.append(f"replica kill: burst after the restart {r['burst_after_back']}")
    return out


def _after(t: float | None, start: float) -> float | None:
    return None if t is None else round(t - start, 3)
