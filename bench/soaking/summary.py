"""The short summary printed on stderr at the end of a run."""

from __future__ import annotations

from .probes import probe_figures


def human_summary(report: dict) -> str:
    out = [f"soak: {'PASSED' if report['passed'] else 'FAILED'} in {report['duration_s']} s"]
    out += tally_lines(report["tallies"])
    out.append(f"leaks after drain: {report['leaks']['final']}")
    out.append(f"leaks after probes: {report['leaks_after_probes']['final']}")
    out.append(f"RSS start {report['rss_start']}, end {report['rss_end']}, growth {report['rss']}")
    for p in report.get("probes", ()):
        out.append(f"probe {p['kind']:<15} {'ok  ' if p['passed'] else 'FAIL'} {probe_figures(p)}")
    if t := report.get("template_trigger"):
        out.append(trigger_line(t))
    if t := report.get("tokenize_flood"):
        out.append(flood_line(t))
    if f := report.get("fault"):
        out += fault_lines(f)
    if r := report.get("replica_kill"):
        out.append(replica_line(r))
    out.append(f"shutdown: {report['shutdown']}")
    out += [f"FAIL: {x}" for x in report["failures"]]
    return "\n".join(out)


def tally_lines(tallies: dict[str, dict]) -> list[str]:
    """A table of the counts per kind, with up to 3 examples under each kind."""
    out = [f"{'kind':<16}{'total':>7}{'result':>8}{'error':>7}{'unexp':>7}{'hang':>6}"]
    for kind, t in tallies.items():
        out.append(
            f"{kind:<16}{t['total']:>7}{t['results']:>8}{t['errors']:>7}"
            f"{t['unexpected']:>7}{t['hangs']:>6}"
        )
        out += [f"    {e}" for e in t["examples"][:3]]
    return out


def fault_lines(f: dict) -> list[str]:
    out = [
        f"fault: {f.get('in_flight')} in flight, {f.get('errors')} errors, "
        f"{f.get('finished_before_kill')} finished, {f.get('unexpected')} unexpected, "
        f"{f.get('hangs')} hangs, last answer {f.get('last_answer_after_s')} s after the kill"
        + (f"; /health {f['health'].get('status')}" if "health" in f else "")
    ]
    if r := f.get("restart"):
        out.append(
            f"    restart: /health {' -> '.join(r['seen'])}, ok {r['ok_after_s']} s after "
            f"the kill, restarts {r['restarts']}, new request {r['new_request']['status']} "
            f"in {r['new_request']['s']} s"
        )
    for name, r in f.get("new_requests", {}).items():
        out.append(f"    new {name}: {r['answer'][:90]} ({r['after_s']} s)")
    return out


def trigger_line(t: dict) -> str:
    return (
        f"template trigger: {t['triggers']} chats {t['trigger_statuses']} in "
        f"{_lat(t['trigger_latency'])}; plain completions {t['plain_statuses']} in "
        f"{_lat(t['plain_latency'])}"
    )


def flood_line(f: dict) -> str:
    return (
        f"tokenize flood: {f['clients']} clients x {f['body_bytes'] // 1000} KB, "
        f"{f['flood_requests']} requests {f['flood_statuses']} in {_lat(f['flood_latency'])}; "
        f"completions {f['completion_statuses']} in {_lat(f['completion_latency'])}"
    )


def replica_line(r: dict) -> str:
    if "error" in r:
        return f"replica kill: {r['error']}"
    return (
        f"replica kill: {r['requests']} requests {r['statuses']}, failed "
        f"{r['failed_started_before_death']} before / {r['failed_started_after_death']} after "
        f"the death was seen ({r['death_seen_after_s']} s; {r['in_flight_at_death']} in "
        f"flight); /health {' -> '.join(r['health_seen'])}; back {r['back_after_s']} s "
        f"after the kill; burst {r['burst_after_back']}"
    )


def _lat(x: dict) -> str:
    return f"median {x['median_s']} s, max {x['max_s']} s"
