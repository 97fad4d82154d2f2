"""Two hosts simulated with a network namespace: the server and rank 0 in this
host's namespace, rank 1 (`pagedserve worker --head`) in a namespace of its own joined by
a veth pair, so every byte between them crosses a network link over tcp://. The test
creates the namespace and link and removes them; without root and iproute2 it skips
and says why.

Checked: TP = 2 across the link answers as one device does; a worker with another
secret is refused; forged, unsealed and tampered frames sent to the worker's plan inbox
and to the head's heartbeat inbox (whose addresses anyone can read in the store) are
refused and logged, and the group keeps serving; SIGTERM to the server stops the
remote rank too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import httpx
import pytest
import torch.distributed as dist

from actors.frame_auth import _HEADER as SEALED_HEADER
from actors.frame_auth import OVERHEAD
from actors.head_record import JOIN_KEY, RUN_KEY, channel, rank_key
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.actors.forged_frames import forgeries, push
from tests.network_namespace import TwoHosts
from web.launch import REPO, ServerProcess, free_port

SECRET = "two-hosts-test-secret-0123456789abcdef"
MODEL = "pagedserve-builtin-tiny"
PROMPT = "Once upon a time"


def _worker(hosts: TwoHosts, port: int, secret_file, log) -> subprocess.Popen:
    """`pagedserve worker` inside the other namespace, as a remote host would run it."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_CLUSTER_SECRET", None)
    cmd = [*("ip", "netns", "exec", hosts.netns), sys.executable, "-m", "web.cli", "worker"]
    head = f"tcp://{hosts.head_ip}:{port}"
    args = ["--head", head, "--rank", "1", "--cluster-secret-file", str(secret_file)]
    return subprocess.Popen(
        [*cmd, *args, "--join-timeout", "90"], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def _secret_file(path, secret: str):
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


def _complete(server: ServerProcess) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _published(hosts: TwoHosts, port: int) -> tuple[str, str, str]:
    """The run id, rank 1's plan inbox and its heartbeat inbox at the head, read from
    the store as anyone on the network can (sealed is not secret)."""
    store = dist.TCPStore(hosts.head_ip, port, None, False, timedelta(seconds=10))
    run_id = store.get(RUN_KEY).decode()
    plans = store.get(rank_key(1))[SEALED_HEADER.size : -(OVERHEAD - SEALED_HEADER.size)]
    join = json.loads(store.get(JOIN_KEY)[SEALED_HEADER.size : -(OVERHEAD - SEALED_HEADER.size)])
    return run_id, plans.decode(), join["heartbeat_addresses"][0]


@pytest.mark.timeout(300)
def test_two_hosts_serve_over_an_authenticated_link(two_hosts, tmp_path):
    with LLM("builtin:tiny", max_model_len=64) as llm:
        [out] = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    expected = out.outputs[0].text
    port = free_port()
    good_log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    bad_log = open(tmp_path / "stranger.log", "wb")  # noqa: SIM115
    stranger = _worker(two_hosts, port, _secret_file(tmp_path / "other", "w" * 40), bad_log)
    worker = _worker(two_hosts, port, _secret_file(tmp_path / "secret", SECRET), good_log)
    server_log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    head = f"{two_hosts.head_ip}:{port}"
    server = ServerProcess(
        [*("--model", "builtin:tiny", "--max-model-len", "64", "-tp", "2", "--local-ranks", "1")]
        + ["--distributed-address", head],
        env={"PAGEDSERVE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"},
        log=server_log,
    )
    try:
        server.start(timeout=180)
        assert stranger.wait(60) == 2
        assert "join record was refused" in (tmp_path / "stranger.log").read_text()
        assert _complete(server) == expected

        run_id, plans, heartbeats = _published(two_hosts, port)
        assert plans.startswith(f"tcp://{two_hosts.worker_ip}:")  # across the link
        push(plans, forgeries(SECRET.encode(), channel(run_id, "plan-1")))
        push(heartbeats, forgeries(SECRET.encode(), channel(run_id, "heartbeat-1")))
        assert _complete(server) == expected  # still two ranks, still serving
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        server.stop()
        for process in (worker, stranger):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in (good_log, bad_log, server_log):
            log.close()
    assert server.proc.returncode == 0
    assert worker.returncode == 0  # the server's Shutdown reached it across the link
    worker_text = (tmp_path / "worker.log").read_text()
    server_text = (tmp_path / "server.log").read_text()
    assert "refused a frame" in worker_text and "bad tag" in worker_text
    assert "refused a frame" in server_text and "heartbeat monitor" in server_text
    for text in (worker_text, server_text):
        assert SECRET not in text
