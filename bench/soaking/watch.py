"""Watching the server: /metrics scraping, the Sampler, the leak check."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx

from .context import Ctx
from .procs import rss_mib, worker_pid
from .progress import log, since

LEAK_GAUGES = (
    "pagedserve_kv_blocks_used",
    "pagedserve_num_requests_running",
    "pagedserve_num_requests_waiting",
    "pagedserve_num_requests_queued",
    "pagedserve_num_requests_live",
    "pagedserve_num_sessions",
    "pagedserve_num_ws_connections",
)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series (name and labels): value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


async def scrape(ctx: Ctx) -> dict[str, float] | None:
    """The server's /metrics (None: no answer within 3 s)."""
    try:
        response = await ctx.http.get(ctx.base_url + "/metrics", timeout=3.0)
        return parse_metrics(response.text)
    except httpx.HTTPError:
        return None


class Sampler:
    """Every `interval` s: RSS of server and worker, requests in flight (client) and
    running (server); a progress line every 10 s of the warm-up and main phases.
    `phase` and `marks` (name -> seconds since start) are set by the phases as they go;
    `hangs_and_unexpected` gives the counts the progress line shows."""

    def __init__(self, ctx: Ctx, server_pid: int, total: int, interval: float) -> None:
        self.ctx, self.server_pid, self.total, self.interval = ctx, server_pid, total, interval
        self.worker_pid = worker_pid(server_pid)
        self.t0 = time.monotonic()
        self.phase = "warm-up"
        self.samples: list[dict] = []
        self.marks: dict[str, float] = {}
        self.hangs_and_unexpected: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def mark(self, name: str) -> None:
        self.marks[name] = self.now()

    async def run(self) -> None:
        last_log = 0.0
        while True:
            self.samples.append(await self.sample())
            if self.phase in ("warm-up", "main") and time.monotonic() - last_log >= 10:
                last_log = time.monotonic()
                self.log_progress()
            await asyncio.sleep(self.interval)

    def log_progress(self) -> None:
        hangs, unexp = self.hangs_and_unexpected()
        log(
            f"{self.ctx.answered}/{self.total} answered, {self.ctx.in_flight} in "
            f"flight, hangs {hangs}, unexpected {unexp}, server RSS "
            f"{self.samples[-1]['server_rss_mib']} MiB, worker "
            f"{self.samples[-1]['worker_rss_mib']} MiB"
        )

    async def sample(self) -> dict:
        metrics = await scrape(self.ctx) or {}
        return {
            "t": self.now(),
            "phase": self.phase,
            "in_flight": self.ctx.in_flight,
            "answered": self.ctx.answered,
            "server_rss_mib": rss_mib(self.server_pid),
            "worker_rss_mib": rss_mib(self.worker_pid),
            "running": metrics.get("pagedserve_num_requests_running"),
            "waiting": metrics.get("pagedserve_num_requests_waiting"),
            "kv_blocks_used": metrics.get("pagedserve_kv_blocks_used"),
        }

    def rss(self) -> dict:
        return {"server_mib": rss_mib(self.server_pid), "worker_mib": rss_mib(self.worker_pid)}


async def check_leaks(ctx: Ctx, settle: float) -> dict:
    """Polls /metrics until every LEAK_GAUGES gauge is 0 or `settle` s pass."""
    start = time.monotonic()
    first = last = None
    while True:
        metrics = await scrape(ctx) or {}
        last = {g: metrics.get(g) for g in LEAK_GAUGES}
        first = first or last
        if all(v == 0 for v in last.values()):
            return {"first_seen": first, "final": last, "zero_after_s": since(start), "leaked": {}}
        if time.monotonic() - start > settle:
            leaked = {g: v for g, v in last.items() if v != 0}
            return {"first_seen": first, "final": last, "zero_after_s": None, "leaked": leaked}
        await asyncio.sleep(0.25)
