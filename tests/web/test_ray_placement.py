"""`pagedserve serve -tp 2 --distributed-executor-backend ray`: the two ranks' workers
start in the bundles of a Ray placement group (a local Ray instance here), children of
Ray's actors rather than of the server, and the server answers as one device does; the
workers are gone after it stops. Skips, saying so, where `ray` is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.web.conftest import assert_completions_match_offline, start_server, stop_server
from tests.web.processes import alive, workers_of

pytestmark = pytest.mark.timeout(240)
PROMPTS = ["Once upon a time", "The cat sat"]


def worker_pids() -> list[int]:
    """Every process running a worker (`actors.worker_actor`)."""
    return [
        int(p.parent.name)
        for p in Path("/proc").glob("[0-9]*/cmdline")
        if b"actors.worker_actor" in _read(p)
    ]


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
