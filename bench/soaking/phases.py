"""The phases in order (main load, leak check, disconnect probes, fault phase, shutdown)
and the client-side record they leave in the report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import httpx

from web.launch import ServerProcess

from .context import Ctx
from .fault import after_kill, fault_batch
from .load import Client, run_requests
from .mix import plan
from .probes import PROBES, probe
from .procs import descendants
from .progress import log
from .server import shutdown
from .watch import Sampler, check_leaks


async def soak(args: argparse.Namespace, server: ServerProcess) -> dict:
    """Every phase against the running `server`: the report's measured part."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        return await phases(Ctx.open(args, server.url, http), server)


async def phases(ctx: Ctx, server: ServerProcess) -> dict:
    """Main load, leak check, disconnect probes, fault phase, shutdown (soak.py's doc),
    sampled all along."""
    client = Client()
    sampler = Sampler(ctx, server.proc.pid, ctx.args.requests, ctx.args.sample_interval)
    sampler.hangs_and_unexpected = client.counts
    sampling = asyncio.create_task(sampler.run())
    report: dict[str, Any] = {"worker_pid": sampler.worker_pid}
    try:
        report |= await main_phase(ctx, sampler, client)
        report |= await after_load(ctx, sampler)
        procs = descendants(server.proc.pid)
        if ctx.args.kill_worker:
            sampler.phase = "fault"
            report["fault"] = await fault_batch(ctx, sampler, server.proc.pid)
            report["fault"] |= await after_kill(ctx)
        sampler.phase = "shutdown"
        sampler.mark("sigterm")
        report["shutdown"] = await asyncio.to_thread(shutdown, server, procs)
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    report["samples"], report["marks"] = sampler.samples, sampler.marks
    return report | client_record(ctx, client)


async def main_phase(ctx: Ctx, sampler: Sampler, client: Client) -> dict:
    """Warm-up (then the RSS baseline), the main load until every request is answered
    (or past its deadline), then RSS again."""
    a = ctx.args
    requests = plan(a.requests, a.weights, a.seed)
    warm = min(a.warmup, a.requests)
    await run_requests(ctx, requests[:warm], client)
    rss_start = sampler.rss()
    sampler.phase = "main"
    sampler.mark("main")
    log(f"warm-up done ({warm} requests); RSS {rss_start}")
    await run_requests(ctx, requests[warm:], client)
    sampler.mark("drained")
    return {
        "rss_start": rss_start,
        "rss_end": sampler.rss(),
        "main_s": round(sampler.marks["drained"] - sampler.marks["main"], 3),
    }


async def after_load(ctx: Ctx, sampler: Sampler) -> dict:
    """The leak check (client sockets closed first), then the disconnect probes and the
    leak check again."""
    sampler.phase = "leak check"
    await ctx.close_pools()
    leaks = await check_leaks(ctx, ctx.args.settle)
    log(f"leak check: {leaks['final']}")
    sampler.phase = "probes"
    sampler.mark("probes")
    probes = [await probe(ctx, kind, ctx.args.probe_requests) for kind in PROBES]
    await ctx.close_pools()
    return {
        "leaks": leaks,
        "probes": probes,
        "leaks_after_probes": await check_leaks(ctx, ctx.args.settle),
    }


def client_record(ctx: Ctx, client: Client) -> dict:
    """Tallies of the kinds sent, counts per malformed variant, what the pools saw."""
    return {
        "tallies": {k: t.as_dict() for k, t in client.tallies.items() if t.total},
        "malformed_variants": {
            kind: {name: dict(c) for name, c in sorted(v.items())}
            for kind, v in client.variants.items()
        },
        "ws_pool_closes_by_server": {
            ("msgpack" if b else "json"): dict(p.server_closes) for b, p in ctx.pools.items()
        },
        "ws_stray_events": [e for p in ctx.pools.values() for e in p.strays][:10],
        "malformed_connections_reused": sum(p.reused for p in ctx.bad_pools.values()),
    }
