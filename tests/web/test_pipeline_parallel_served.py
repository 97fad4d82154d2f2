"""`pagedserve serve -pp 2`: the model's layers in two stages, one worker process each;
the server answers completions as one device does and its workers are gone after it
stops."""

from __future__ import annotations

import json
import urllib.request

import pytest

from engine import LLM, SamplingParams
from tests.web.conftest import start_server, stop_server
from tests.web.processes import alive, workers_of

PROMPTS = ["Once upon a time", "The cat sat"]


@pytest.mark.timeout(180)
def test_two_stages_served_answer_as_one_device() -> None:
    server = start_server(extra=["--pipeline-parallel-size", "2"])
    try:
        workers = workers_of(server.process.proc.pid)
        assert len(workers) == 2
        offline = LLM("builtin:tiny", kv_cache_memory=32 << 20)
        params = SamplingParams(temperature=0, max_tokens=16)
        for prompt in PROMPTS:
            body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            request = urllib.request.Request(
                f"{server.http}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as reply:
                text = json.load(reply)["choices"][0]["text"]
            [want] = offline.generate(prompt, params, use_tqdm=False)
            assert text == want.outputs[0].text
    finally:
        stop_server(server)
    assert not any(alive(pid) for pid in workers)
