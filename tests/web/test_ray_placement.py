"""`pagedserve serve -tp 2 --distributed-executor-backend ray`: the two ranks' workers
start in the bundles of a Ray placement group (a local Ray instance here), children of
Ray's actors rather than of the server, and the server answers as one device does; the
workers are gone after it stops. Across two Ray nodes (the second in another network
namespace) the other node's rank joins over the link. Skips, saying so, where `ray` is
not installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.web.conftest import (
    RunningServer,
    assert_completions_match_offline,
    start_server,
    stop_server,
)
from tests.web.processes import alive, workers_of
from web.launch import REPO, ServerProcess, free_ports

pytestmark = pytest.mark.timeout(240)
PROMPTS = ["Once upon a time", "The cat sat"]


def worker_pids(module: bytes = b"actors.worker_actor") -> list[int]:
    """Every process running `module` (by default a worker)."""
    return [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline") if module in _read(p)]


def parent_command(pid: int) -> bytes:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return _read(Path(f"/proc/{stat[1]}/cmdline"))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_ranks_placed_by_ray_answer_as_one_device() -> None:
    pytest.importorskip("ray", reason="ray is not installed (bash .ci/setup installs it)")
    server = start_server(extra=["-tp", "2", "--distributed-executor-backend", "ray"])
    try:
        ranks = [pid for pid in worker_pids() if b"ray::" in parent_command(pid)]
        assert len(ranks) == 2  # each a child of a Ray actor, not of the server
        assert not workers_of(server.process.proc.pid)
        assert_completions_match_offline(server, PROMPTS)
    finally:
        stop_server(server)
    assert not any(alive(pid) for pid in ranks)


def _ray(*args: str, env: dict[str, str], prefix: tuple[str, ...] = ()) -> None:
    subprocess.run([*prefix, "ray", *args], env=env, check=True, capture_output=True, timeout=120)


def test_ranks_on_two_ray_nodes_answer_as_one_device(two_hosts, tmp_path) -> None:
    """A Ray cluster of two nodes, the second in another network namespace, one CPU
    each: Ray puts one rank on each, and the rank on the other node joins this server's
    head over the link as `pagedserve worker --head` (the cluster secret from its
    environment), while rank 0 runs here."""
    pytest.importorskip("ray", reason="ray is not installed (bash .ci/setup installs it)")
    secret = "ray-two-nodes-test-secret-0123456789"
    gcs_port, http, store = free_ports(3)
    gcs = f"{two_hosts.head_ip}:{gcs_port}"
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN="0" * 32 + "pagedserve-test",
        PAGEDSERVE_CLUSTER_SECRET=secret,
        OMP_NUM_THREADS="1",
    )
    node = ["start", "--num-cpus", "1", "--disable-usage-stats"]
    try:
        _ray(
            *node,
            "--head",
            "--node-ip-address",
            two_hosts.head_ip,
            "--port",
            gcs.split(":")[1],
            "--include-dashboard",
            "false",
            env=env,
        )
        _ray(
            *node,
            "--address",
            gcs,
            "--node-ip-address",
            two_hosts.worker_ip,
            env=env,
            prefix=two_hosts.exec_prefix,
        )
        log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
        server = ServerProcess(
            ["--model", "builtin:tiny", "--kv-cache-memory", str(64 << 20), "-tp", "2"]
            + ["--distributed-executor-backend", "ray"]
            + ["--distributed-address", f"{two_hosts.head_ip}:{store}"],
            port=http,
            env={k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "OMP_NUM_THREADS")}
            | {"RAY_ADDRESS": gcs, "PAGEDSERVE_CLUSTER_SECRET": secret},
            log=log,
        )
        server.start(timeout=180)
        try:
            remote = [
                p for p in worker_pids(b"web.cli") if b"--head" in _read(Path(f"/proc/{p}/cmdline"))
            ]
            assert len(remote) == 1  # the other node's rank
            model = "pagedserve-builtin-tiny"
            assert_completions_match_offline(
                RunningServer(server.port, model, None, None, server), PROMPTS
            )
        finally:
            server.stop()
            log.close()
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
