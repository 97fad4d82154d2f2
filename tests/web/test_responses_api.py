"""`/v1/responses` through the official `openai` client: text, instructions and item
lists, `text.format` structured output, function tools and their outputs, each as the
chat route serves the same conversation; what a stateless server cannot do is a 400
naming the Responses field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI

from tests.web.recording_engine import RecordingEngine, recording_app

pytestmark = pytest.mark.timeout(180)

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "mood": {"enum": ["calm", "busy"]},
    },
    "required": ["x", "mood"],
}
TOOL = {"type": "function", "name": "move", "parameters": POINT}


def api(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="-", timeout=120)


async def test_text_equals_the_chat_reply_to_the_same_turns(builtin_server) -> None:
    async with api(builtin_server) as client:
        resp = await client.responses.create(
            model=builtin_server.model,
            instructions="Be brief.",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
            max_output_tokens=8,
            temperature=0,
        )
        chat = await client.chat.completions.create(
            model=builtin_server.model,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello"},
            ],
            max_completion_tokens=8,
            temperature=0,
        )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    if cut:
        assert resp.incomplete_details.reason == "max_output_tokens"


async def test_text_format_becomes_the_requests_grammar() -> None:
    """In-process: the schema reaches the engine as the request's constraint (on the
    random model, free JSON whitespace can run to the length limit; the tool test
    below checks a grammar-written output end to end)."""
    engine = RecordingEngine(reply='{"x": 1, "mood": "calm"}')
    fmt = {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}
    transport = httpx.ASGITransport(app=recording_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://recorded") as http:
        reply = await http.post(
            "/v1/responses", json={"input": "A point.", "text": {"format": fmt}}
        )
    assert reply.status_code == 200, reply.text
    assert json.loads(engine.params.structured_outputs.json) == POINT
    [message] = reply.json()["output"]
    assert message["content"][0] == {"type": "output_text", "text": engine.reply, "annotations": []}
    assert reply.json()["status"] == "completed"


async def test_function_tools_are_called_and_their_outputs_accepted(builtin_server) -> None:
    async with api(builtin_server) as client:
        resp = await client.responses.create(
            model=builtin_server.model,
            input="Move somewhere.",
            tools=[TOOL],
            tool_choice="required",
            temperature=0,
        )
        [call] = [item for item in resp.output if item.type == "function_call"]
        assert call.name == "move" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), POINT)
        follow = await client.responses.create(
            model=builtin_server.model,
            input=[
                {"role": "user", "content": "Move somewhere."},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": "move",
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "moved"},
            ],
            tools=[TOOL],
            tool_choice="none",
            max_output_tokens=4,
        )
    assert follow.output[0].type == "message"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"stream": True}, "stream"),
        ({"store": True}, "store"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "name": "jump"}},
            "tool_choice.name",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_refusals_name_the_responses_field(builtin_server, body, param) -> None:
    reply = httpx.post(
        f"{builtin_server.http}/v1/responses",
        json={"model": builtin_server.model, "input": "hi", **body},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
