"""Run `pagedserve serve` as a child process and wait until it is healthy (tests,
benchmarks, scripts that need a real server on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now: all are held while they are chosen,
    so a server given two of them (HTTP and KV transfer) never gets one port twice."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


class ServerProcess:
    """`python -m web.cli serve --port PORT *args` with this repository importable.

    `start()` returns once GET /health answers 200 (raises RuntimeError, with the log
    tail when `log` is a file, if the process exits or the timeout passes); `stop()`
    sends SIGTERM (the server's graceful shutdown), then SIGKILL after 30 s.
    `own_group`: the server leads a process group of its own (with its worker), as a
    server started from a terminal does; a terminal's Ctrl-C is SIGINT to that group.
    `prefix`: a command the server runs under (`ip netns exec NS`: another network
    namespace, which `host` reaches)."""

    def __init__(
        self,
        args: list[str],
        port: int | None = None,
        env: dict[str, str] | None = None,
        log: IO[bytes] | None = None,
        own_group: bool = False,
        prefix: tuple[str, ...] = (),
        host: str = "127.0.0.1",
    ) -> None:
        self.port = port or free_port()
        self.host = host
        serve = [sys.executable, "-m", "web.cli", "serve", "--port", str(self.port), *args]
        self.cmd = [*prefix, *serve]
        self.env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        self.log = log
        self.own_group = own_group
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        out = self.log if self.log is not None else None
        err = subprocess.STDOUT if self.log is not None else None
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            env=self.env,
            stdout=out,
            stderr=err,
            start_new_session=self.own_group,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (OSError, http.client.HTTPException):  # not up, or not it (yet)
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout:.0f} s{self._tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _tail(self, lines: int = 30) -> str:
        if self.log is None or not hasattr(self.log, "name"):
            return ""
        text = Path(self.log.name).read_text(errors="replace").splitlines()[-lines:]
        return ":\n" + "\n".join(text)
