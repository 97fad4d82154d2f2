"""An accepted value is an honoured one: each value that once reached the routes and
changed nothing (chat's `logprobs: true` without top_logprobs, a max_tokens behind a
null max_completion_tokens, beam search extras without a beam search) now does what it
says or is refused naming the field. In-process around a recording engine (what reaches
the engine), and on the built-in model (what comes back)."""

from __future__ import annotations

import httpx
import pytest
from openai import AsyncOpenAI

from tests.web.recording_engine import RecordingEngine, recording_app

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]
CHAT = {"messages": MESSAGES, "temperature": 0}
COMPLETION = {"prompt": "Once upon a time", "temperature": 0}


async def _post(engine: RecordingEngine, route: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=recording_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://recorded") as http:
        return await http.post(f"/v1/{route}", json=body, timeout=30)


# -- chat logprobs: true alone -------------------------------------------------------------
@pytest.mark.parametrize("top", [{}, {"top_logprobs": None}, {"top_logprobs": 0}])
async def test_chat_logprobs_alone_asks_the_engine_for_the_chosen_tokens(top: dict) -> None:
    engine = RecordingEngine(reply="hi")
    reply = await _post(engine, "chat/completions", {**CHAT, "logprobs": True, **top})
    assert reply.status_code == 200, reply.text
    assert engine.params.logprobs == 0  # the sampled token's own logprob, no alternatives
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "hi", "logprob": -0.5, "bytes": [104, 105], "top_logprobs": []}]
    for off in ({}, {"logprobs": False}, {"logprobs": None}):
        reply = await _post(engine, "chat/completions", {**CHAT, **off})
        assert reply.json()["choices"][0]["logprobs"] is None
        assert engine.params.logprobs is None


async def test_chat_logprobs_alone_on_a_server(builtin_server) -> None:
    """As OpenAI and vLLM: each chosen token's logprob, with an empty top_logprobs,
    plain and streamed."""
    kwargs = dict(model=builtin_server.model, max_tokens=8, logprobs=True, **CHAT)
    async with AsyncOpenAI(base_url=f"{builtin_server.http}/v1", api_key="-", timeout=60) as api:
        out = await api.chat.completions.create(**kwargs)
        stream = await api.chat.completions.create(stream=True, **kwargs)
        streamed = [t async for c in stream for ch in c.choices for t in _tokens(ch)]
    content = out.choices[0].logprobs.content
    assert content, "no logprobs for logprobs: true"
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(t.top_logprobs == [] and t.logprob <= 0 for t in content)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert all(t.top_logprobs == [] for t in streamed)


def _tokens(choice) -> list:
    return choice.logprobs.content if choice.logprobs and choice.logprobs.content else []


@pytest.mark.parametrize("top", ["3", 21, -1, True])
async def test_a_bad_top_logprobs_is_named(top) -> None:
    engine = RecordingEngine()
    reply = await _post(engine, "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": top})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "top_logprobs"
    assert engine.requests == []


# -- max_tokens and max_completion_tokens ---------------------------------------------------
@pytest.mark.parametrize(
    ("route", "body", "want"),
    [
        ("completions", {"max_completion_tokens": None, "max_tokens": 3}, 3),
        ("chat/completions", {"max_completion_tokens": None, "max_tokens": 3}, 3),
        ("chat/completions", {"max_tokens": None, "max_completion_tokens": 5}, 5),
        ("chat/completions", {"max_tokens": 5, "max_completion_tokens": 5}, 5),
    ],
)
async def test_a_null_length_field_hides_no_other(route: str, body: dict, want: int) -> None:
    engine = RecordingEngine()
    base = CHAT if route.startswith("chat") else COMPLETION
    reply = await _post(engine, route, {**base, **body})
    assert reply.status_code == 200, reply.text
    assert engine.params.max_tokens == want


async def test_two_different_lengths_are_refused() -> None:
    engine = RecordingEngine()
    body = {**CHAT, "max_tokens": 3, "max_completion_tokens": 5}
    reply = await _post(engine, "chat/completions", body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert "max_tokens" in error["message"] and "max_completion_tokens" in error["message"]
    assert engine.requests == []


# -- beam search extras ----------------------------------------------------------------------
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [({"length_penalty": 0.5}, "length_penalty"), ({"early_stopping": True}, "early_stopping")],
)
async def test_beam_extras_need_a_beam_search(route: str, extra: dict, param: str) -> None:
    engine = RecordingEngine()
    base = CHAT if route.startswith("chat") else COMPLETION
    reply = await _post(engine, route, {**base, **extra})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and "use_beam_search" in error["message"]
    defaults = {"length_penalty": 1.0, "early_stopping": False}  # what sampling does anyway
    assert (await _post(engine, route, {**base, **defaults})).status_code == 200
    beams = await _post(engine, route, {**base, **extra, "use_beam_search": True})
    assert beams.status_code == 200, beams.text
    assert getattr(engine.params, param) == extra[param]
