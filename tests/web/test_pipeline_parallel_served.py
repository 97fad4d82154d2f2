"""`pagedserve serve -pp 2`: the model's layers in two stages, one worker process each;
the server answers completions as one device does and its workers are gone after it
stops."""

from __future__ import annotations

import pytest

from tests.web.conftest import assert_completions_match_offline, start_server, stop_server
from tests.web.processes import alive, workers_of


@pytest.mark.timeout(180)
def test_two_stages_served_answer_as_one_device() -> None:
    server = start_server(extra=["--pipeline-parallel-size", "2"])
    try:
        workers = workers_of(server.process.proc.pid)
        assert len(workers) == 2
        assert_completions_match_offline(server, ["Once upon a time", "The cat sat"])
    finally:
        stop_server(server)
    assert not any(alive(pid) for pid in workers)
