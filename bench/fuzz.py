"""Long fuzz runs: tests/web/test_fuzz.py with many more Hypothesis examples per target.

    python bench/fuzz.py --examples 5000                        # every target, 5000 each
    python bench/fuzz.py --examples 2000 -k ws --out /tmp/fuzz.json

It runs pytest on tests/web/test_fuzz.py with PAGEDSERVE_FUZZ_EXAMPLES set (and
PAGEDSERVE_FUZZ_TIMEOUT with --timeout), shows pytest's output as it goes and then a
summary (both on stderr), and prints the report as JSON (stdout; with --out, also that
file): per test, passed/failed, seconds, the examples run and what they ended in (200,
400 invalid_request, done, error not_found, closed 1009, ...), the slowest example, and
the first line of a failure. Hypothesis keeps failing examples in .hypothesis/
(gitignored) and replays them first next time. The exit status is pytest's (0: all
passed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent)]

from report import write_report  # noqa: E402

TEST_FILE = "tests/web/test_fuzz.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=2000, help="Hypothesis examples per target")
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds before a request counts as a hang"
    )
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k: which targets to run")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    return p.parse_args(argv)


def pytest_command(args: argparse.Namespace, junit: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST_FILE]
    cmd += [f"--junitxml={junit}", "--hypothesis-show-statistics"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if args.seed is not None:
        cmd += [f"--hypothesis-seed={args.seed}"]
    if args.exitfirst:
        cmd += ["-x"]
    return cmd


def read_junit(path: Path) -> list[dict]:
    """Each test case: name, outcome, seconds, the first line of its failure."""
    if not path.is_file():
        return []
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, failure = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                failure = (node.get("message") or "").splitlines()[0][:300] or None
                break
        tests.append(
            {
                "test": case.get("name"),
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0.0), 2),
                "failure": failure,
            }
        )
    return tests


def summary_lines(report: dict) -> list[str]:
    lines = [f"fuzz: {report['examples_per_target']} examples per target"]
    for t in report["tests"]:
        line = f"  {t['test']}: {t['outcome']} in {t['seconds']:.1f} s"
        if "examples_run" in t:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(t["outcomes"].items()))
            line += f"; {t['examples_run']} examples ({counts})"
        if t["failure"]:
            line += f"\n    {t['failure']}"
        lines.append(line)
    verdict = "passed" if report["passed"] else "FAILED"
    lines.append(f"fuzz: {verdict} in {report['seconds']:.1f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedserve-fuzz-") as tmp:
        junit, stats_path = Path(tmp) / "junit.xml", Path(tmp) / "stats.json"
        env = dict(
            os.environ,
            PAGEDSERVE_FUZZ_EXAMPLES=str(args.examples),
            PAGEDSERVE_FUZZ_STATS=str(stats_path),
        )
        if args.timeout is not None:
            env["PAGEDSERVE_FUZZ_TIMEOUT"] = str(args.timeout)
        cmd = pytest_command(args, junit)
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        start = time.monotonic()
        code = subprocess.call(cmd, cwd=REPO, env=env, stdout=sys.stderr)  # stdout: the JSON
        seconds = time.monotonic() - start
        tests = read_junit(junit)
        stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    for t in tests:
        if t["test"] in stats:
            s = stats[t["test"]]
            t |= {"examples_run": s["examples"], "outcomes": s["outcomes"], "slowest": s["slowest"]}
    report = {
        "command": " ".join(["python", "bench/fuzz.py", *(argv or sys.argv[1:])]),
        "examples_per_target": args.examples,
        "timeout_s": args.timeout,
        "seconds": round(seconds, 1),
        "passed": code == 0,
        "pytest_exit_code": code,
        "tests": tests,
        "platform": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    print("\n".join(summary_lines(report)), file=sys.stderr)
    write_report(report, args.out, plot=lambda _png: None)
    return code


if __name__ == "__main__":
    sys.exit(main())
