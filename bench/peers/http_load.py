"""Loopback HTTP load for the served systems, and peak RSS of a process tree (stdlib only).

`send_all` posts every body at t=0, one thread and one connection per request (the server
queues what it cannot run yet), and times from just before the first send to the last
answer. The same client drives llama-server and `pagedserve serve`, so client overhead
is the same for both.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


def post_json(port: int, path: str, body: dict, timeout: float) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        answer = conn.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status} from {path}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def healthy(port: int) -> bool:
    """GET /health answered 200."""
    conn = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@dataclass(frozen=True)
class LoadResult:
    """`answers[i]` is request i's JSON answer, None when it failed (see `errors`)."""

    wall_s: float
    answers: list[dict | None]
    errors: list[tuple[int, str]]


def send_all(port: int, path: str, bodies: list[dict], timeout: float = 3600.0) -> LoadResult:
    answers: list[dict | None] = [None] * len(bodies)
    errors: list[tuple[int, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(len(bodies) + 1)

    def one(i: int) -> None:
        start.wait()
        try:
            answers[i] = post_json(port, path, bodies[i], timeout)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            with lock:
                errors.append((i, repr(exc)))

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        futures = [pool.submit(one, i) for i in range(len(bodies))]
        start.wait()  # every thread is up: all requests leave together
        t0 = time.perf_counter()
        for f in futures:
            f.result()
        wall = time.perf_counter() - t0
    return LoadResult(wall, answers, sorted(errors))


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/PID/task/TID/children)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return tree


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
