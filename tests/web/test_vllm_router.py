"""Two `pagedserve serve` replicas behind `vllm-router` (the Rust router vLLM users run
for data parallelism): the router forwards completions, chat completions and streams,
with the fields it adds to every request (`no_stop_trim`, `return_hidden_states`,
`separate_reasoning`, `stream_reasoning`) honoured; the answers are a lone server's, and
both replicas serve. Skips, saying so, where vllm-router is not installed (`bash
.ci/setup` puts it in .venv-router/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.eventually import eventually_sync
from tests.web.conftest import start_server, stop_server
from web.launch import free_ports

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "The cat sat", "Tom said hello", "the dog and"]


def router_binary() -> str:
    found = os.environ.get("PAGEDSERVE_VLLM_ROUTER") or shutil.which("vllm-router")
    local = REPO / ".venv-router" / "bin" / "vllm-router"
    if found is None and local.exists():
        found = str(local)
    if found is None:
        pytest.skip("vllm-router is not installed (bash .ci/setup installs it in .venv-router/)")
    return found


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read()


def post(url: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.read()


def healthy(url: str) -> bool:
    try:
        get(f"{url}/health")
    except OSError:
        return False
    return True


def served_requests(server) -> float:
    text = get(f"{server.http}/metrics").decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


@pytest.fixture(scope="module")
def routed():
    binary = router_binary()
    replicas = [start_server(), start_server()]
    port, metrics_port = free_ports(2)
    workers = [r.http for r in replicas]
    router = subprocess.Popen(
        [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
        + ["--worker-urls", *workers, "--worker-startup-timeout-secs", "60"]
        + ["--prometheus-port", str(metrics_port)],  # its own, beside other routers
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        eventually_sync(lambda: healthy(url), timeout=60, what="vllm-router's /health")
        yield url, replicas
    finally:
        router.terminate()
        router.wait(timeout=20)
        for replica in replicas:
            stop_server(replica)


def test_the_router_forwards_completions_chat_and_streams(routed) -> None:
    url, replicas = routed
    direct = replicas[0].http
    model = replicas[0].model
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        got = json.loads(post(f"{url}/v1/completions", body))["choices"][0]["text"]
        want = json.loads(post(f"{direct}/v1/completions", body))["choices"][0]["text"]
        assert got == want
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat["temperature"] = 0
    got = json.loads(post(f"{url}/v1/chat/completions", chat))["choices"][0]["message"]
    want = json.loads(post(f"{direct}/v1/chat/completions", chat))["choices"][0]["message"]
    assert got["content"] == want["content"]
    stream = post(f"{url}/v1/completions", {**body, "stream": True}).decode()
    assert stream.rstrip().endswith("data: [DONE]")
    assert served_requests(replicas[1]) > 0  # only the router sends there: round robin
