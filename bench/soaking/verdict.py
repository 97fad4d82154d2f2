"""The pass criteria applied to a finished report, and its RSS growth figures."""

from __future__ import annotations

from .fault import refused_ok
from .flood import flood_failures
from .probes import probe_figures
from .replica import replica_failures
from .restart import restart_failures
from .server import SHUTDOWN_S
from .trigger import trigger_failures


def verdict(r: dict) -> list[str]:
    """Why the run failed (empty: it passed)."""
    t = r["tallies"].values()
    failures = []
    hangs, unexp = sum(x["hangs"] for x in t), sum(x["unexpected"] for x in t)
    if hangs:
        failures.append(f"{hangs} request(s) hung")
    if unexp:
        failures.append(f"{unexp} unexpected answer(s)")
    closes = sum(sum(c.values()) for c in r["ws_pool_closes_by_server"].values())
    if closes:
        failures.append(f"{closes} pooled WebSocket(s) closed by the server")
    for name in ("leaks", "leaks_after_probes"):
        if r.get(name, {}).get("leaked"):
            failures.append(f"{name}: gauges not back to 0: {r[name]['leaked']}")
    failures += [
        f"probe {p['kind']}: {probe_figures(p)}" for p in r.get("probes", ()) if not p["passed"]
    ]
    failures += trigger_failures(r.get("template_trigger"))
    failures += flood_failures(r.get("tokenize_flood"))
    failures += fault_failures(r.get("fault"))
    failures += replica_failures(r.get("replica_kill"))
    failures += shutdown_failures(r.get("shutdown", {}))
    return failures


def fault_failures(f: dict | None) -> list[str]:
    """The fault phase's failures (none when it was skipped): hangs or unexpected answers
    of the requests in flight; then the restart's failures, or, with --no-restart,
    /health not 503 or a new request not refused at once."""
    if f is None:
        return []
    if "error" in f:
        return [f"fault phase: {f['error']}"]
    out = []
    if f["hangs"] or f["unexpected"]:
        out.append(f"fault phase: {f['hangs']} hang(s), {f['unexpected']} unexpected answer(s)")
    if "restart" in f:
        return out + restart_failures(f["restart"])
    for key in ("health", "health_after_refusals"):
        if f[key].get("status") != 503:
            out.append(f"fault phase: /health said {f[key].get('status')} ({key})")
    for name, r in f["new_requests"].items():
        if not refused_ok(r["answer"]) or r["after_s"] > 2.0:
            out.append(
                f"fault phase: new {name} request: {r['answer'][:80]} after {r['after_s']} s"
            )
    return out


def shutdown_failures(s: dict) -> list[str]:
    out = []
    if s.get("exit_code") is None or s.get("exit_after_s", 0) > SHUTDOWN_S:
        out.append(f"server did not exit within {SHUTDOWN_S:g} s of SIGTERM")
    if s.get("processes_left"):
        out.append(f"processes left after shutdown: {s['processes_left']}")
    return out


def growth(r: dict) -> dict:
    """RSS growth from the baseline to the end of the main phase, in %, and its slope in
    MiB per 1000 requests over the second half of the load (past the warm-up's jump;
    samples with at least half --concurrency in flight)."""
    start, end = r.get("rss_start") or {}, r.get("rss_end") or {}
    out = {}
    for key in ("server_mib", "worker_mib"):
        if start.get(key) and end.get(key):
            out[key.replace("_mib", "_pct")] = round(100 * (end[key] / start[key] - 1), 1)
    busy = r["config"]["concurrency"] / 2
    loaded = [x for x in r["samples"] if x["phase"] == "main" and x["in_flight"] >= busy]
    late = loaded[len(loaded) // 2 :]
    for key in ("server_mib", "worker_mib"):
        points = [(x["answered"], x[key.replace("_mib", "_rss_mib")]) for x in late]
        slope = fit_slope([p for p in points if p[1] is not None])
        if slope is not None:
            out[key.replace("_mib", "_mib_per_1k_requests")] = round(1000 * slope, 3)
    return out


def fit_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None for fewer than 5 points or no spread."""
    if len(points) < 5:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / var
