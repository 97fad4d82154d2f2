"""`pagedserve serve --kv-cache-dtype int8`: /v1/info says what the cache holds, and a
greedy completion is the offline engine's with the same cache; a value the CLI does not
know is refused naming the flag."""

from __future__ import annotations

import json
import urllib.request

import pytest
from openai import AsyncOpenAI

from engine import LLM, SamplingParams
from tests.web.conftest import start_server, stop_server
from web.cli import main

pytestmark = pytest.mark.timeout(180)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def int8_server():
    server = start_server(extra=["--kv-cache-dtype", "int8"])
    yield server
    stop_server(server)


async def test_the_server_runs_and_reports_an_int8_cache(int8_server) -> None:
    with urllib.request.urlopen(f"{int8_server.http}/v1/info", timeout=30) as reply:
        memory = json.load(reply)["memory"]
    assert memory["kv_cache_dtype"] == "int8" and memory["kv_cache_bytes"] > 0
    api = AsyncOpenAI(base_url=f"{int8_server.http}/v1", api_key="none", timeout=60)
    out = await api.completions.create(
        model=int8_server.model, prompt=PROMPT, max_tokens=16, temperature=0
    )
    llm = LLM("builtin:tiny", kv_cache_memory=16 << 20, kv_cache_dtype="int8")
    params = SamplingParams(temperature=0, max_tokens=16)
    assert out.choices[0].text == llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_an_unknown_value_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "builtin:tiny", "--kv-cache-dtype", "fp16"])
    assert exit_.value.code == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
