"""`pagedserve serve --speculative-config ...`: the served engine (actors, one step ahead)
verifies prompt-lookup drafts, or a draft model's, and answers greedy requests, streamed
and not, with the offline engine's text without speculation, stop strings included;
/metrics counts the drafts under vLLM's names; a config we cannot honour is refused
naming the field."""

from __future__ import annotations

import json
import urllib.request

import pytest
from openai import AsyncOpenAI

from engine import LLM, SamplingParams
from tests.web.conftest import start_server, stop_server
from web.cli import main

pytestmark = pytest.mark.timeout(180)

CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPTS = [
    "Once upon a time there was a cat. Once upon a time there was a",
    "the dog and the cat and the dog and the cat and the",
    "Tom said hello. Tom said hello. Tom said",
]


@pytest.fixture(scope="module")
def spec_server():
    server = start_server(extra=["--speculative-config", json.dumps(CONFIG)])
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def offline():
    with LLM("builtin:tiny", kv_cache_memory=64 << 20, max_num_seqs=64) as llm:
        yield llm


def metric(server, name: str) -> float:
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


async def test_greedy_completions_equal_plain_decoding(spec_server, offline) -> None:
    api = AsyncOpenAI(base_url=f"{spec_server.http}/v1", api_key="none", timeout=60)
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, text in zip(PROMPTS, expected, strict=True):
        out = await api.completions.create(
            model=spec_server.model, prompt=prompt, max_tokens=40, temperature=0
        )
        assert out.choices[0].text == text
        stream = await api.completions.create(
            model=spec_server.model, prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream]) == text
    assert metric(spec_server, "vllm:spec_decode_num_draft_tokens_total") > 0
    assert metric(spec_server, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert metric(spec_server, "vllm:spec_decode_num_accepted_tokens_per_pos_total") > 0


async def test_stop_strings_end_the_text_where_plain_decoding_does(spec_server, offline) -> None:
    api = AsyncOpenAI(base_url=f"{spec_server.http}/v1", api_key="none", timeout=60)
    for prompt in PROMPTS:
        [full] = offline.generate(
            prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
        )
        words = full.outputs[0].text.split()
        stop = words[len(words) // 2] if words else "x"
        params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
        [cut] = offline.generate(prompt, params, use_tqdm=False)
        out = await api.completions.create(
            model=spec_server.model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop]
        )
        assert out.choices[0].text == cut.outputs[0].text
        assert out.choices[0].finish_reason == cut.outputs[0].finish_reason


async def test_a_draft_model_serves_the_same_text(offline) -> None:
    draft = {"method": "draft_model", "model": "builtin:tiny", "num_speculative_tokens": 3}
    server = start_server(extra=["--speculative-config", json.dumps(draft)])
    try:
        api = AsyncOpenAI(base_url=f"{server.http}/v1", api_key="none", timeout=60)
        params = SamplingParams(temperature=0, max_tokens=32)
        for prompt in PROMPTS:
            [want] = offline.generate(prompt, params, use_tqdm=False)
            stream = await api.completions.create(
                model=server.model, prompt=prompt, max_tokens=32, temperature=0, stream=True
            )
            assert "".join([c.choices[0].text async for c in stream]) == want.outputs[0].text
        accepted = metric(server, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted == metric(server, "vllm:spec_decode_num_draft_tokens_total") > 0
    finally:
        stop_server(server)


def test_a_config_we_cannot_honour_is_refused_by_name(capsys) -> None:
    for bad, name in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
        ("not json", "JSON"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model", "builtin:tiny", "--speculative-config", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--speculative-config" in err and name in err
