"""Server start-up time: launch to a healthy /health and to the first streamed token.

Each run launches `python -m web.cli serve --port P` (`--model`, default the built-in
tiny model) as a subprocess of a checkout, and records, in seconds from the launch:
- `healthy_s`: the first 200 from GET /health (polled every 10 ms);
- `first_token_s`: the first streamed token of a 1-token completion sent right then
  (`first_request_s` = first_token_s - healthy_s: what the first request costs);
- the phases of each process (lane), from their own log lines: the server's (imports,
  config and app, the engine's start, listening) and the worker's from its launch
  (imports, config, kernels, model, KV cache, its ready message received). The two
  processes share one stderr pipe, read line by line here; each line is stamped when
  it arrives, within a millisecond of its writing. A phase ends at its line and starts
  at the end of its lane's previous phase; a line that a checkout does not log (an
  older one) merges its phase into the next. The worker's phases overlap the server's
  where it is launched early.

`--checkout NAME=PATH` (repeatable) measures other checkouts too, alternating run by run
so that noise from a shared machine hits all alike (a baseline: `git archive REV | tar
-x -C DIR`); `--runs` rounds (default 3); the report keeps every run and each figure's
median. On a shared machine, `--wait-idle PCT` starts each round only once the CPUs
were at least PCT% idle over 2 s (waiting at most `--idle-timeout` s; each run records
the idle share its round started at): the server and its worker start in parallel, so
a machine with no free core hides what overlapping them gains. Floors for reference: a
bare interpreter (`python -c pass`) and `import torch`, each timed `--runs` times.

`--async-engine` also times, per checkout and round, `await AsyncEngine.start(...)` on
the built-in model in a fresh interpreter (what the SDK's in-process users, the tests
and the benches pay; from the call to its return, imports excluded).

    python bench/startup.py --out bench/results/startup.json
    python bench/startup.py --checkout before=/tmp/base --checkout after=. --runs 5 \\
        --out bench/results/startup.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import invocation, machine, write_report  # noqa: E402

from web.launch import free_port  # noqa: E402


@dataclass(frozen=True)
class Phase:
    """A start-up phase of one process (`lane`): it ends at the first log line matching
    `ends_at`, and starts where the lane's previous phase found ended."""

    lane: str  # "server" or "worker"
    name: str
    ends_at: str  # regex
    what: str


PHASES = (
    Phase("server", "server imports", r"no --model given", "interpreter, the CLI's imports"),
    Phase(
        "server",
        "server config + app",
        r"Started server process",
        "the CLI's EngineArgs.build() (transformers config), the app, uvicorn's set-up",
    ),
    Phase(
        "server",
        "engine start",
        r"web\.app: serving",
        "the lifespan: this process's config and tokenizer, waiting for the worker's "
        "ready message, the actors",
    ),
    Phase("server", "uvicorn listening", r"Uvicorn running on", "the socket bound"),
    Phase("worker", "worker imports", r"worker-0 .*imports done", "interpreter and imports"),
    Phase("worker", "worker config", r"worker-0 .*engine config built", "its EngineArgs.build()"),
    Phase("worker", "kernels loaded", r"worker-0 .*attention backend:", "native kernels loaded"),
    Phase(
        "worker",
        "model loaded",
        r"worker-0 .*KV cache: \d+ blocks",
        "model built, weights loaded (CUDA: the memory-profiling warm-up pass)",
    ),
    Phase("worker", "KV cache allocated", r"worker-0 INFO ready:", "the KV cache tensors"),
    Phase(
        "worker",
        "ready received",
        r"worker 0 ready .* after its launch",
        "the server has the worker's ready message (and its own config and tokenizer)",
    ),
)
LANES = ("server", "worker")
# The worker lane starts at its launch; checkouts that do not log it launch it when the
# lifespan starts.
WORKER_LAUNCHED = (r"spawned worker 0", r"Waiting for application startup")
HEALTH_POLL_S = 0.01


@dataclass
class Run:
    checkout: str
    idle_pct: float | None  # the CPUs' idle share over 2 s before the round started
    healthy_s: float
    first_token_s: float
    first_request_s: float
    phases: dict[str, float]
    marks: dict[str, float]


def log(msg: str) -> None:
    print(f"[startup] {msg}", file=sys.stderr, flush=True)


class LogReader:
    """Reads a process's output line by line on a thread, stamping each line."""

    def __init__(self, stream, start: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self._start = start
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for raw in stream:
            self.lines.append((time.perf_counter() - self._start, raw.decode(errors="replace")))

    def join(self) -> None:
        self._thread.join(timeout=30)


def launch(
    name: str, checkout: Path, model: str | None, extra: list[str], idle: float | None
) -> Run:
    port = free_port()
    cmd = [sys.executable, "-m", "web.cli", "serve", "--port", str(port)]
    cmd += ["--model", model] + extra
    env = dict(os.environ, PYTHONPATH=str(checkout))
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    reader = LogReader(proc.stdout, start)
    try:
        healthy = wait_healthy(port, proc, start)
        first_token = first_token_at(port, start)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join()
    marks = find_marks(reader.lines)
    return Run(
        name,
        idle,
        round(healthy, 3),
        round(first_token, 3),
        round(first_token - healthy, 3),
        phases_of(marks, healthy, first_token),
        {k: round(v, 3) for k, v in marks.items()},
    )


def wait_healthy(port: int, proc: subprocess.Popen, start: float, timeout: float = 300) -> float:
    url = f"http://127.0.0.1:{port}/health"
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"not healthy after {timeout} s")


def first_token_at(port: int, start: float) -> float:
    """Seconds from `start` to the first SSE chunk with text of a 1-token completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "stream": True, "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"completion answered {response.status}: {response.read()[:300]!r}")
    try:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - start
        raise RuntimeError("the stream ended without a token")
    finally:
        conn.close()


def find_marks(lines: list[tuple[float, str]]) -> dict[str, float]:
    """When each phase's line arrived (phases whose line never came are left out), and
    when the worker was launched ("worker launched")."""
    marks = {}
    for name, pattern in [(p.name, p.ends_at) for p in PHASES] + [
        ("worker launched", w) for w in WORKER_LAUNCHED
    ]:
        if name in marks:
            continue
        found = next((t for t, line in lines if re.search(pattern, line)), None)
        if found is not None:
            marks[name] = found
    return marks


def phases_of(marks: dict[str, float], healthy: float, first_token: float) -> dict[str, float]:
    """Each lane's phases in seconds: a phase's end minus the end of the lane's previous
    phase found (a missing phase's time goes to the next one found). The server lane
    ends with /health and the first token."""
    out = {}
    for lane in LANES:
        previous = marks.get("worker launched", 0.0) if lane == "worker" else 0.0
        for phase in (p for p in PHASES if p.lane == lane):
            if phase.name in marks:
                out[phase.name] = round(marks[phase.name] - previous, 3)
                previous = marks[phase.name]
        if lane == "server":
            out["first /health 200"] = round(healthy - previous, 3)
            out["first token"] = round(first_token - healthy, 3)
    return out


def idle_pct(seconds: float = 2.0) -> float | None:
    """The share of CPU time spent idle over the next `seconds` (None off Linux)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return round(100 * (idle1 - idle0) / max(1, total1 - total0), 1)


def wait_idle(threshold: float | None, timeout: float) -> float | None:
    """Waits until the CPUs are `threshold`% idle (or `timeout` passes); the last share."""
    if threshold is None:
        return None
    deadline = time.monotonic() + timeout
    while True:
        idle = idle_pct()
        if idle is None or idle >= threshold or time.monotonic() > deadline:
            return idle


ASYNC_ENGINE_START = """
import asyncio, time
from actors.async_engine import AsyncEngine
from engine.engine_args import EngineArgs
from engine.worker.builtin_model import builtin_model_dir

async def main():
    start = time.perf_counter()
    engine = await AsyncEngine.start(EngineArgs(model=str(builtin_model_dir())))
    print("async-engine-start", time.perf_counter() - start)
    await engine.shutdown()

asyncio.run(main())
"""


def async_engine_start_s(checkout: Path) -> float:
    """Seconds `AsyncEngine.start` takes in a fresh interpreter of `checkout`."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run(
        [sys.executable, "-c", ASYNC_ENGINE_START],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return round(float(out.split("async-engine-start", 1)[1].split()[0]), 3)


def floor_s(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def summarize(runs: list[Run]) -> dict:
    names = [p.name for p in PHASES] + ["first /health 200", "first token"]
    launched = [r.marks["worker launched"] for r in runs if "worker launched" in r.marks]
    phases = {}
    for name in names:
        values = [r.phases[name] for r in runs if name in r.phases]
        if values:
            phases[name] = round(statistics.median(values), 3)
    return dict(
        runs=len(runs),
        healthy_s=round(statistics.median(r.healthy_s for r in runs), 3),
        healthy_min_s=min(r.healthy_s for r in runs),
        healthy_max_s=max(r.healthy_s for r in runs),
        first_token_s=round(statistics.median(r.first_token_s for r in runs), 3),
        first_request_s=round(statistics.median(r.first_request_s for r in runs), 3),
        worker_launched_s=round(statistics.median(launched), 3) if launched else None,
        phases_median_s=phases,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="launches per checkout")
    p.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a checkout to measure (repeatable; default: this one, as 'this')",
    )
    p.add_argument(
        "--model",
        default="builtin:tiny",
        help="--model for serve (default builtin:tiny; SmolLM2-135M-Instruct: the default model)",
    )
    p.add_argument("--serve-arg", action="append", default=[], help="an extra serve argument")
    p.add_argument("--async-engine", action="store_true", help="also time AsyncEngine.start")
    p.add_argument("--wait-idle", type=float, default=None, metavar="PCT")
    p.add_argument("--idle-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    checkouts = dict(c.split("=", 1) for c in a.checkout) or {"this": str(REPO)}
    checkouts = {name: Path(path).resolve() for name, path in checkouts.items()}
    runs: dict[str, list[Run]] = {name: [] for name in checkouts}
    engine_starts: dict[str, list[float]] = {name: [] for name in checkouts}
    for i in range(a.runs):
        idle = wait_idle(a.wait_idle, a.idle_timeout)
        for name, path in checkouts.items():
            run = launch(name, path, a.model, a.serve_arg, idle)
            log(
                f"run {i} {name}: healthy {run.healthy_s} s, first token {run.first_token_s} s"
                f" (CPUs {idle}% idle before the round)"
            )
            if a.async_engine:
                engine_starts[name].append(async_engine_start_s(path))
                log(f"run {i} {name}: AsyncEngine.start {engine_starts[name][-1]} s")
            runs[name].append(run)
    floors = {
        "python -c pass": [floor_s("pass") for _ in range(a.runs)],
        "import torch": [floor_s("import torch") for _ in range(a.runs)],
    }
    result = dict(
        command=invocation(__file__),
        model=a.model,
        serve_args=a.serve_arg,
        phases={ph.name: ph.what for ph in PHASES},
        summary={name: summarize(rs) for name, rs in runs.items()},
        async_engine_start_median_s={
            name: round(statistics.median(t), 3) for name, t in engine_starts.items() if t
        },
        async_engine_start_s={name: t for name, t in engine_starts.items() if t},
        floors_median_s={k: round(statistics.median(v), 3) for k, v in floors.items()},
        checkouts={name: str(path) for name, path in checkouts.items()},
        runs=[vars(r) for rs in runs.values() for r in rs],
        machine=dict(machine(), cpus=os.cpu_count()),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


def plot(result: dict, path: Path) -> None:
    """Per checkout, two bars of median phases: the server's, and the worker's from its
    launch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    lanes = {
        "server": [p.name for p in PHASES if p.lane == "server"]
        + ["first /health 200", "first token"],
        "worker": [p.name for p in PHASES if p.lane == "worker"],
    }
    palette = plt.get_cmap("tab20").colors
    colors = {phase: palette[i % len(palette)] for i, phase in enumerate(sum(lanes.values(), []))}
    fig, ax = plt.subplots(figsize=(10, 2.2 + 0.8 * len(summary)))
    labels = []
    for name, s in summary.items():
        for lane, phases in lanes.items():
            row = len(labels)
            labels.append(f"{name}: {lane}")
            left = (s["worker_launched_s"] or 0.0) if lane == "worker" else 0.0
            for phase in phases:
                width = s["phases_median_s"].get(phase)
                if width:
                    ax.barh(row, width, left=left, color=colors[phase], label=phase)
                    left += width
            ax.text(left + 0.05, row, f"{left:.2f} s", va="center", fontsize=8)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=4)  # fmt: skip
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from launch (median of each phase)")
    ax.set_title("pagedserve serve start-up, built-in tiny model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
