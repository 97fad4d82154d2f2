"""Real servers on 127.0.0.1: `pagedserve serve` in a subprocess (one per session and
configuration)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from web.launch import ServerProcess

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260K"


@dataclass(frozen=True)
class RunningServer:
    """A `pagedserve serve` process and where to reach it."""

    port: int
    model: str  # the served model name
    model_dir: str | None  # None: the built-in model
    api_key: str | None
    process: ServerProcess

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


def start_server(
    model_dir: str | None = None,
    api_key: str | None = None,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> RunningServer:
    args = ["--max-num-seqs", "64", "--kv-cache-memory", str(64 << 20)]
    if model_dir is None:
        args += ["--model", "builtin:tiny"]
    else:
        args += ["--model", model_dir, "--served-model-name", "test-model"]
    if api_key is not None:
        args += ["--api-key", api_key]
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    process = ServerProcess(args + (extra or []), port=port, env=env)
    process.start(timeout=120)
    name = "pagedserve-builtin-tiny" if model_dir is None else "test-model"
    return RunningServer(process.port, name, model_dir, api_key, process)


def assert_completions_match_offline(server: RunningServer, prompts: list[str]) -> None:
    """The server's greedy 16-token completion of each prompt is the built-in model's
    offline text."""
    from engine import LLM, SamplingParams

    with LLM("builtin:tiny", kv_cache_memory=32 << 20) as offline:
        params = SamplingParams(temperature=0, max_tokens=16)
        wants = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    for prompt, want in zip(prompts, wants, strict=True):
        body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        request = urllib.request.Request(
            f"{server.http}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.load(reply)["choices"][0]["text"] == want


def stop_server(server: RunningServer) -> None:
    server.process.stop()


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
