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
    if f := report.get("fault"):
        out += fault_lines(f)
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
        f"{f.get('hangs')} hangs, last answer {f.get('last_answer_after_s')} s after the "
        f"kill; /health {f.get('health', {}).get('status')}"
    ]
    for name, r in f.get("new_requests", {}).items():
        out.append(f"    new {name}: {r['answer'][:90]} ({r['after_s']} s)")
    return out
