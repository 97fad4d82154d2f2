"""The phases in order (main load, leak check, disconnect probes, template trigger,
tokenize flood, fault phase, shutdown) and the client-side record they leave in the
report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import httpx

from web.launch import ServerProcess

from .context import Ctx
from .fault import after_kill, fault_batch
from .flood import tokenize_flood
from .load import Client, run_requests
from .mix import plan
from .probes import PROBES, probe
from .procs import descendants, worker_pid
from .progress import log
from .restart import after_restart
from .server import shutdown
from .trigger import template_trigger
from .watch import Sampler, check_leaks


async def soak(args: argparse.Namespace, server: ServerProcess) -> dict:
    """Every phase against the running `server`: the report's measured part."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        return await phases(Ctx.open(args, server.url, http), server)


async def phases(ctx: Ctx, server: ServerProcess) -> dict:
    """Main load, leak check, disconnect probes, template trigger, tokenize flood, fault
    phase, shutdown (soak.py's doc), sampled all along."""
    client = Client()
    sampler = Sampler(ctx, server.proc.pid, ctx.args.requests, ctx.args.sample_interval)
    sampler.hangs_and_unexpected = client.counts
    sampling = asyncio.create_task(sampler.run())
    report: dict[str, Any] = {"worker_pid": sampler.worker_pid}
    try:
        report |= await main_phase(ctx, sampler, client)
        report |= await after_load(ctx, sampler)
        report |= await hostile_clients(ctx, sampler)
        if ctx.args.kill_worker:
            report["fault"] = await fault_phase(ctx, sampler, server.proc.pid)
        procs = descendants(server.proc.pid)  # the restarted worker's too
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


async def hostile_clients(ctx: Ctx, sampler: Sampler) -> dict:
    """The template trigger and the tokenize flood (each skipped when set to 0)."""
    a, out = ctx.args, {}
    if a.template_triggers:
        sampler.phase = "template trigger"
        sampler.mark("trigger")
        out["template_trigger"] = await template_trigger(ctx, a.template_triggers)
        log(f"template trigger: {out['template_trigger']['trigger_latency']}")
    if a.flood_clients:
        sampler.phase = "tokenize flood"
        sampler.mark("flood")
        out["tokenize_flood"] = await tokenize_flood(ctx, a.flood_clients, a.flood_seconds)
        log(f"tokenize flood: {out['tokenize_flood']['completion_latency']}")
    return out


async def fault_phase(ctx: Ctx, sampler: Sampler, server_pid: int) -> dict:
    """SIGKILL to the worker under load; then, with --no-restart, /health and refusals,
    else the restart (and the new worker becomes the one sampled)."""
    sampler.phase = "fault"
    fault = await fault_batch(ctx, sampler, server_pid)
    if "error" in fault:
        return fault
    if ctx.args.no_restart:
        return fault | await after_kill(ctx)
    killed = sampler.t0 + sampler.marks["kill"]
    fault["restart"] = await after_restart(ctx, killed)
    sampler.worker_pid = worker_pid(server_pid)
    log(f"restart: {fault['restart']['seen']}, ok after {fault['restart']['ok_after_s']} s")
    return fault


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
