"""Chat history cut to the model's context by tokens: a server-kept session (and a
stateless chat with `fit_history`) drops its oldest turns, never the system prompt, so
a long chat on a small context keeps working; a turn that alone cannot fit is refused
with an error saying so."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.web.conftest import start_server, stop_server
from web.client import AsyncClient, InvalidRequestError
from web.errors import ApiError
from web.sessions import SessionStore, fit_history, reply_room

MAX_MODEL_LEN = 256
SYSTEM = "You tell short stories."


@pytest.fixture(scope="module")
def small_context():
    """The built-in model (byte-level tokenizer) with a 256-token context."""
    server = start_server(extra=["--max-model-len", str(MAX_MODEL_LEN)])
    yield server
    stop_server(server)


# -- the rule, on its own ------------------------------------------------------------
def chat(num_turns: int, system: bool = True) -> list[dict[str, str]]:
    head = [{"role": "system", "content": "S" * 10}] if system else []
    turns = []
    for i in range(num_turns):
        turns += [
            {"role": "user", "content": f"u{i}" * 5},
            {"role": "assistant", "content": "a" * 10},
        ]
    return head + turns + [{"role": "user", "content": "last"}]


def counter(calls: list[int]):
    """A token count: each message's characters plus 4 (its template tags)."""

    async def count(messages):
        calls.append(len(messages))
        return sum(len(m["content"]) + 4 for m in messages)

    return count


@pytest.mark.parametrize("num_turns", [0, 1, 3, 40, 400])
async def test_fit_keeps_system_and_last_message_and_drops_whole_turns(num_turns) -> None:
    messages, calls = chat(num_turns), []
    room = 100 - reply_room(100, 16)
    fitted, dropped = await fit_history(messages, counter(calls), 100, 16, "message")
    assert fitted[0]["role"] == "system" and fitted[-1]["content"] == "last"
    assert fitted[1:] == messages[1 + dropped :]
    assert dropped % 2 == 0 and (len(fitted) == 2 or fitted[1]["role"] == "user")
    size = sum(len(m["content"]) + 4 for m in fitted)
    assert size <= room
    if dropped:  # as few left out as fit: one more turn would not
        assert size + sum(len(m["content"]) + 4 for m in messages[dropped - 1 : dropped + 1]) > room
    assert len(calls) <= 3 + (num_turns + 1).bit_length()  # a binary search, not a scan


async def test_fit_refuses_a_message_that_alone_cannot_fit() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "x" * 300}]
    with pytest.raises(ApiError, match="take 309 tokens, and at most 128 fit") as raised:
        await fit_history(messages, counter([]), 256, 200, "message")
    assert raised.value.code == "invalid_request" and raised.value.param == "message"


def test_the_reply_keeps_max_tokens_but_at_most_half_the_context() -> None:
    assert reply_room(256, 16) == 16
    assert reply_room(256, 1000) == reply_room(256, None) == 128


def test_forget_oldest_keeps_the_system_prompt() -> None:
    store = SessionStore()
    session = store.open("me", system="S")
    session.messages += chat(2, system=False)[:-1]
    store.forget_oldest(session, 2)
    assert [m["content"] for m in session.messages] == ["S", "u1" * 5, "a" * 10]


# -- on a real server ----------------------------------------------------------------
@pytest.mark.timeout(120)
async def test_a_long_session_on_a_small_context_keeps_working(small_context) -> None:
    async with AsyncClient(small_context.ws, timeout=60) as client:
        chat_ = client.chat_session(system=SYSTEM)
        dropped = 0
        for turn in range(12):
            result = await chat_.send(f"turn {turn}: tell me more", max_tokens=16).collect()
            assert result.finish_reason in ("stop", "length"), (turn, result)
            assert result.usage.prompt_tokens <= MAX_MODEL_LEN - 16
            dropped += result.dropped_messages
        assert dropped > 0  # without cutting, turn 5 or so would not fit
        history = await chat_.history()
        assert history[0] == {"role": "system", "content": SYSTEM}
        assert history[-2] == {"role": "user", "content": "turn 11: tell me more"}
        assert [m["role"] for m in history[1:]] == ["user", "assistant"] * ((len(history) - 1) // 2)

        with pytest.raises(InvalidRequestError, match="even without earlier turns") as raised:
            await chat_.send("x" * 300, max_tokens=16).collect()
        assert raised.value.param == "message"
        result = await chat_.send("and a short one", max_tokens=16).collect()  # goes on
        assert result.finish_reason in ("stop", "length")
        assert (await chat_.history())[0]["content"] == SYSTEM


@pytest.mark.timeout(120)
async def test_fit_history_cuts_a_stateless_chat_and_says_how_much(small_context) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(12):
        messages += [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": "an answer"},
        ]
    messages.append({"role": "user", "content": "the last question"})
    async with AsyncClient(small_context.ws, timeout=60) as client:
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await client.complete(messages=messages, max_tokens=16)  # as sent: too long
        result = await client.complete(messages=messages, max_tokens=16, fit_history=True)
    assert result.dropped_messages > 0 and result.dropped_messages % 2 == 0
    assert result.usage.prompt_tokens <= MAX_MODEL_LEN - 16
    async with websockets.connect(f"{small_context.ws}/v1/stream") as ws:  # the wire
        frame = {"type": "generate", "id": "g", "messages": messages, "fit_history": "yes"}
        await ws.send(json.dumps(frame))
        refused = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert refused["code"] == "invalid_request" and refused["param"] == "fit_history"
