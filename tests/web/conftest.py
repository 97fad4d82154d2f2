"""Real servers on 127.0.0.1: `pagedserve serve` in a subprocess (one per session and
configuration)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260K"


@dataclass(frozen=True)
class RunningServer:
    """A `pagedserve serve` process and where to reach it."""

    port: int
    model: str  # the served model name
    model_dir: str | None  # None: the built-in model
    api_key: str | None
    process: subprocess.Popen

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """One unlabelled sample from /metrics."""
        request = urllib.request.Request(f"{self.http}/metrics")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(request, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir: str | None = None, api_key: str | None = None, extra: list[str] | None = None
) -> RunningServer:
    port = free_port()
    cmd = [sys.executable, "-m", "web.cli", "serve", "--port", str(port)]
    cmd += ["--max-num-seqs", "64", "--kv-cache-memory", str(64 << 20)]
    if model_dir is not None:
        cmd += ["--model", model_dir, "--served-model-name", "test-model"]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    cmd += extra or []
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy in 120 s")
    name = "pagedserve-builtin-tiny" if model_dir is None else "test-model"
    return RunningServer(port, name, model_dir, api_key, proc)


def stop_server(server: RunningServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def builtin_server() -> Iterator[RunningServer]:
    """The built-in tiny model (no ../shared needed)."""
    server = start_server()
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def stories_server() -> Iterator[RunningServer]:
    if not STORIES.is_dir():
        pytest.skip("needs ../shared/models/stories260K")
    server = start_server(str(STORIES))
    yield server
    stop_server(server)
