"""Soak and fault script for `pagedserve serve` (not a test; not run in CI).

    python bench/soak.py --quick --out /tmp/soak_quick.json      # 300 requests, ~2 min
    python bench/soak.py --out bench/results/soak.json           # 5000 requests

It starts its own server (stories260K from ../shared by default) and checks, in order:

1. Main phase: `--requests` requests (a seeded random mix of the kinds in KINDS, at most
   `--concurrency` in flight) over WebSocket (JSON and msgpack, multiplexed on reused
   connections), SSE and plain HTTP: requests run to the end, cancelled, disconnected
   mid-stream, abandoned by a non-streaming client, oversize frames and bodies, malformed
   frames and bodies, multi-turn chat sessions. Each request has a client-side deadline
   (`--deadline`): no terminal answer in time (done / error event, HTTP response, SSE
   [DONE] or error chunk, a close code) is a HANG. Per kind: results (completed as
   expected), errors (the expected error answers), unexpected answers (with examples) and
   hangs. Server and worker RSS are sampled every `--sample-interval` seconds.
2. Leaks: once every request is answered and the client's sockets are closed, the
   /metrics gauges in LEAK_GAUGES (KV blocks used, running / waiting / queued / live
   requests, sessions, WebSocket connections) must all be back to 0 within `--settle` s.
3. Disconnect probes: a few long requests per way of leaving (WebSocket cancel and
   disconnect, SSE disconnect, a non-streaming HTTP client giving up); after the client
   left, the server must stop decoding them (running and live requests at 0 within
   PROBE_RELEASE_S, no request of them finishing with "length").
4. Template trigger (`--template-triggers`): the server runs a `--chat-template` of ours
   (trigger.py) that loops for hours on a message containing TRIGGER. Trigger chats (two
   at a time) beside plain one-token completions: every trigger must be refused with
   HTTP 400 `invalid_request` naming --chat-template within TRIGGER_ANSWER_S, every
   plain completion answered 200 within PLAIN_ANSWER_S.
5. Tokenize flood (`--flood-clients`, `--flood-seconds`): clients post prompts of
   FLOOD_BYTES (capped 1 KiB under --max-message-bytes, so that the server reads them)
   to /tokenize back to back while five one-token completions are timed: every flood
   request refused (400, or 503 past the tokenizer's queue) within FLOOD_ANSWER_S, the
   completions 200 with a median under COMPLETION_MEDIAN_S.
6. Fault phase (`--kill-worker`, on by default): long WebSocket, SSE and plain HTTP
   requests are streaming when the worker process gets SIGKILL. Every one must end with
   an error (WS `error` event or a documented close code, SSE error chunk or end of
   stream, HTTP 5xx) within FAULT_ANSWER_S. The server replaces the worker: /health may
   say 503 `restarting` (nothing else but 200 `ok`), must be 200 `ok` again within
   RESTART_OK_S, pagedserve_num_worker_restarts_total must be 1 and a new request must
   be served. With `--no-restart` (the server gets --max-worker-restarts 0) /health must
   say 503 instead and new requests must be refused with an error at once.
7. Shutdown: SIGTERM; the server must exit within SHUTDOWN_S and leave no worker behind.
8. Replica kill (`--replica-kill`, off by default): a second server with
   --data-parallel-size 2 under a steady stream (STREAM_CONCURRENCY clients); one
   replica's worker gets SIGKILL. No request started after the death was first seen
   (/health or pagedserve_replica_healthy) may fail, at most the ones in flight from the
   kill until then; /health must stay 200 `degraded` until it is `ok` again with every
   replica at 1 within REPLICA_BACK_S; then a burst of BURST requests must all be served.

Pass criteria (exit status 0 only if all hold): no hangs, no unexpected answers, every
leak gauge back to 0 (so no leaked KV blocks), every disconnect probe released, and the
template trigger, tokenize flood, fault phase, shutdown and replica kill as above. The
JSON report (bench/report.py's write_report) and a PNG (RSS of server and worker,
requests in flight, the kill) go to `--out`; a short summary goes to stderr.

This file is the command line; the pieces live in bench/soaking/ (its __init__ lists them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import write_report  # noqa: E402
from soaking.mix import KINDS, QUICK_MALFORMED_WEIGHTS, parse_weights  # noqa: E402
from soaking.phases import soak  # noqa: E402
from soaking.plot import plot  # noqa: E402
from soaking.progress import log, since  # noqa: E402
from soaking.replica import replica_kill  # noqa: E402
from soaking.server import DEFAULT_MODEL, server_args, server_log_summary  # noqa: E402
from soaking.summary import human_summary  # noqa: E402
from soaking.trigger import write_template  # noqa: E402
from soaking.verdict import growth, verdict  # noqa: E402

from web.launch import ServerProcess  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="JSON report path (a PNG is written beside it)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="300 requests, malformed kinds weighted up to send each variant about once",
    )
    p.add_argument("--requests", type=int, default=None, help="default 5000 (300 with --quick)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=100, help="requests before the RSS baseline")
    p.add_argument(
        "--weights",
        type=parse_weights,
        default=parse_weights(None),
        help="kind=weight,... overriding the defaults (" + ", ".join(KINDS) + ")",
    )
    p.add_argument("--ws-connections", type=int, default=4, help="pooled sockets per encoding")
    p.add_argument("--settle", type=float, default=5.0, help="seconds for gauges to reach 0")
    p.add_argument("--sample-interval", type=float, default=1.0)
    p.add_argument("--probe-requests", type=int, default=4, help="per disconnect probe")
    p.add_argument("--long-tokens", type=int, default=448, help="probes and fault requests")
    p.add_argument(
        "--kill-worker",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fault phase: SIGKILL the worker under load (default: on)",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="run the server with --max-worker-restarts 0: after the kill it must stay 503",
    )
    p.add_argument(
        "--replica-kill",
        action="store_true",
        help="then a second server with --data-parallel-size 2: SIGKILL to one replica's worker",
    )
    p.add_argument(
        "--template-triggers", type=int, default=6, help="chats (0: no hostile template)"
    )
    p.add_argument("--flood-clients", type=int, default=16, help="/tokenize flooders (0: none)")
    p.add_argument("--flood-seconds", type=float, default=4.0)
    p.add_argument("--fault-ws", type=int, default=16)
    p.add_argument("--fault-sse", type=int, default=8)
    p.add_argument("--fault-http", type=int, default=8)
    s = p.add_argument_group("server")
    s.add_argument("--model", default=str(DEFAULT_MODEL))
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: no preempt)")
    s.add_argument("--max-message-bytes", type=int, default=65536)
    s.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the server")
    s.add_argument("--server-args", default="", help="more `pagedserve serve` flags, quoted")
    s.add_argument("--server-log", default=None, help="default: a file in the temp dir")
    a = p.parse_args(argv)
    a.requests = a.requests or (300 if a.quick else 5000)
    if a.quick:
        a.warmup = min(a.warmup, 30)
        a.weights = a.weights | QUICK_MALFORMED_WEIGHTS
    if a.requests < 1 or a.concurrency < 1 or a.ws_connections < 1:
        p.error("--requests, --concurrency and --ws-connections must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not Path(a.model, "config.json").is_file():
        print(f"error: {a.model}/config.json not found (--model)", file=sys.stderr)
        return 2
    log_path = Path(a.server_log or tempfile.mkstemp(prefix="pagedserve-soak-", suffix=".log")[1])
    threads = str(a.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pagedserve-soak-") as tmp, log_path.open("wb") as f:
        a.chat_template_file = str(write_template(Path(tmp))) if a.template_triggers else None
        server = ServerProcess(server_args(a), env=env, log=f)
        log(f"starting server: {shlex.join(server.cmd)} (log: {log_path})")
        server.start(timeout=300)
        try:
            measured = asyncio.run(soak(a, server))
        finally:
            server.stop()
        if a.replica_kill:
            measured["replica_kill"] = asyncio.run(replica_kill(a, env, f))
    report = full_report(a, server, since(start), measured, log_path)
    write_report(report, a.out, lambda png: plot(report, png))
    print(human_summary(report), file=sys.stderr)
    return 0 if report["passed"] else 1


def full_report(
    a: argparse.Namespace, server: ServerProcess, duration: float, measured: dict, log_path: Path
) -> dict:
    """The run's settings and machine, what the phases measured, the server log's
    summary, RSS growth and the verdict."""
    config = {k: v for k, v in vars(a).items()} | {"model": str(a.model)}
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "config": config,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "server": {"command": shlex.join(server.cmd), "pid": server.proc.pid},
        "duration_s": duration,
        **measured,
        "server_log": server_log_summary(log_path),
    }
    report["rss"] = growth(report)
    report["failures"] = verdict(report)
    report["passed"] = not report["failures"]
    return report


if __name__ == "__main__":
    sys.exit(main())
