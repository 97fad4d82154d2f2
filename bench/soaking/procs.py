"""Processes as /proc shows them: RSS, command lines, the server's process tree."""

from __future__ import annotations

import contextlib
from pathlib import Path


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of `pid` in MiB (None: no such process)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces (OSError: no such process)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid`."""
    out = {}
    for child in children(pid):
        with contextlib.suppress(OSError):
            out[child] = cmdline(child)
        out |= descendants(child)
    return out


def worker_pid(server_pid: int) -> int | None:
    found = [p for p, cmd in descendants(server_pid).items() if "actors.worker_actor" in cmd]
    return found[0] if found else None


def still_alive(procs: dict[int, str]) -> list[str]:
    """The processes of `procs` still running (same pid and command line; zombies are
    reported as such)."""
    alive = []
    for pid, cmd in procs.items():
        try:
            now = cmdline(pid)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if now == cmd:
            alive.append(f"{pid} ({cmd[:60]})" + (" zombie" if state == "Z" else ""))
        elif state == "Z" and not now:
            alive.append(f"{pid} zombie")
    return alive
