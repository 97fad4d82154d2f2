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


async def test_a_streamed_response_adds_up_to_the_whole_one(builtin_server) -> None:
    kwargs = dict(model=builtin_server.model, input="Hello", max_output_tokens=12, temperature=0)
    async with api(builtin_server) as client:
        whole = await client.responses.create(**kwargs)
        async with client.responses.stream(**kwargs) as stream:  # the SDK checks the events
            events = [e async for e in stream]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1]
    assert final.type == f"response.{whole.status}"  # completed, or incomplete when cut
    assert "".join(deltas) == final.response.output_text == whole.output_text
    assert final.response.usage.output_tokens == whole.usage.output_tokens


async def test_streamed_function_call_arguments_add_up(builtin_server) -> None:
    kwargs = dict(
        model=builtin_server.model,
        input="Move.",
        tools=[TOOL],
        tool_choice="required",
        temperature=0,
    )
    async with api(builtin_server) as client:
        events = [e async for e in await client.responses.create(stream=True, **kwargs)]
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and "".join(fragments) == done.arguments
    jsonschema.validate(json.loads(done.arguments), POINT)
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.arguments == done.arguments and call.name == "move"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"stream": True, "stream_options": {"include_obfuscation": False}}, "stream_options"),
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


async def test_streamed_events_bring_reasoning_then_calls_in_order() -> None:
    """In-process, canned text through --reasoning-parser qwen3 and hermes tool calls:
    each item opens, streams and closes before the next, ids kept to the end."""
    from tests.web.recording_engine import MODEL
    from web.chat_parsing import ChatParsing
    from web.server_config import ServerConfig

    call = '{"name": "move", "arguments": {"x": 1, "mood": "calm"}}'
    text = f"<think>thinking</think><tool_call>{call}</tool_call>"
    engine = RecordingEngine(pieces=tuple(text[i : i + 4] for i in range(0, len(text), 4)))
    config = ServerConfig(model_name=MODEL, chat_parsing=ChatParsing("hermes", True, "qwen3"))
    transport = httpx.ASGITransport(app=recording_app(engine, config))
    body = {"input": "Move.", "tools": [TOOL], "stream": True}
    async with httpx.AsyncClient(transport=transport, base_url="http://recorded") as http:
        reply = await http.post("/v1/responses", json=body)
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "thinking"
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert [item["id"] for item in output] == [
        e["item"]["id"] for e in events if e["type"] == "response.output_item.done"
    ]
    assert json.loads(output[1]["arguments"]) == {"x": 1, "mood": "calm"}
