"""Tool calling on /v1/chat/completions: tools and tool turns reach the chat template,
`required` and a named function are written by a grammar (the arguments validate
against the function's schema on the built-in random model), `auto` is parsed from the
model's text by --tool-call-parser, reasoning is split off by --reasoning-parser, plain
and streamed alike; what cannot be honoured is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI

from engine.messages import ChatPrompt
from tests.web.recording_engine import MODEL, RecordingEngine, recording_app
from web.chat_parsing import ChatParsing
from web.server_config import ServerConfig

pytestmark = pytest.mark.timeout(180)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASCII = {str(b): -100 for b in range(0x80, 0x100)}  # the random model's bytes: keep ASCII
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"},
]


# -- on the built-in model: a grammar writes the calls -------------------------------------
def api(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="-", timeout=120)


def kwargs(server, **extra) -> dict:
    return (
        dict(model=server.model, tools=TOOLS, max_tokens=200, temperature=0, logit_bias=ASCII)
        | extra
    )


def check_calls(calls) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_calls_validate_against_their_schemas(builtin_server) -> None:
    async with api(builtin_server) as client:
        out = await client.chat.completions.create(
            messages=ASK, tool_choice="required", **kwargs(builtin_server)
        )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


async def test_a_named_function_is_the_one_called(builtin_server) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    async with api(builtin_server) as client:
        out = await client.chat.completions.create(
            messages=ASK, tool_choice=named, **kwargs(builtin_server)
        )
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call])
    assert out.choices[0].finish_reason == "tool_calls"


async def test_one_call_when_parallel_tool_calls_is_false(builtin_server) -> None:
    async with api(builtin_server) as client:
        out = await client.chat.completions.create(
            messages=ASK,
            tool_choice="required",
            parallel_tool_calls=False,
            **kwargs(builtin_server),
        )
    assert len(out.choices[0].message.tool_calls) == 1
    check_calls(out.choices[0].message.tool_calls)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_streamed_call_reassembles_to_the_whole_one(builtin_server, choice) -> None:
    async with api(builtin_server) as client:
        whole = await client.chat.completions.create(
            messages=ASK, tool_choice=choice, **kwargs(builtin_server)
        )
        stream = await client.chat.completions.create(
            messages=ASK, tool_choice=choice, stream=True, **kwargs(builtin_server)
        )
        calls: dict[int, dict] = {}
        fragments, finish = 0, None
        async for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or ():
                    call = calls.setdefault(
                        d.index, {"id": d.id, "name": d.function.name, "args": ""}
                    )
                    fragments += bool(d.function.arguments)
                    call["args"] += d.function.arguments or ""
    want = whole.choices[0].message.tool_calls
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        (w.function.name, w.function.arguments) for w in want
    ]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    assert fragments > len(calls)  # the arguments came as they were generated, not at the end
    assert finish == "tool_calls"


async def test_a_history_with_tool_turns_is_answered(builtin_server) -> None:
    async with api(builtin_server) as client:
        out = await client.chat.completions.create(
            messages=HISTORY, tool_choice="none", **kwargs(builtin_server, max_tokens=8)
        )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")


# -- in-process, around a recording engine: auto calls and reasoning from canned text ------
AUTO = ChatParsing("hermes", True, "qwen3")
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
REPLY = "<think>The user wants weather.</think>" + CALL_TEXT


async def post(body: dict, engine: RecordingEngine, parsing: ChatParsing = AUTO) -> httpx.Response:
    app = recording_app(engine, ServerConfig(model_name=MODEL, chat_parsing=parsing))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://recorded") as http:
        return await http.post("/v1/chat/completions", json=body, timeout=30)


def sse_chunks(text: str) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def test_auto_calls_and_reasoning_are_parsed_from_the_text() -> None:
    engine = RecordingEngine(reply=REPLY)
    reply = await post({"messages": ASK, "tools": TOOLS}, engine)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    assert choice["finish_reason"] == "tool_calls"
    prompt, params = engine.requests[-1]
    assert isinstance(prompt, ChatPrompt)
    assert prompt.template_args.variables()["tools"] == TOOLS
    assert params.structured_outputs is None  # auto: free text, parsed afterwards


async def test_auto_streamed_in_small_pieces_adds_up_to_the_whole() -> None:
    pieces = tuple(REPLY[i : i + 3] for i in range(0, len(REPLY), 3))
    reply = await post(
        {"messages": ASK, "tools": TOOLS, "stream": True}, RecordingEngine(pieces=pieces)
    )
    chunks = sse_chunks(reply.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls", ())]
    assert reasoning == "The user wants weather." and content == ""
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    args = "".join(t["function"]["arguments"] for t in calls)
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert deltas[0]["role"] == "assistant"


async def test_include_reasoning_false_drops_it_and_template_kwargs_reach_the_template() -> None:
    engine = RecordingEngine(reply="<think>hidden</think>Paris is sunny.")
    body = {
        "messages": ASK,
        "include_reasoning": False,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    reply = await post(body, engine)
    message = reply.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris is sunny."}
    prompt, _ = engine.requests[-1]
    assert prompt.template_args.variables() == {"enable_thinking": True}


async def test_forced_choices_become_grammars_over_the_tools_schemas() -> None:
    engine = RecordingEngine(reply="{}")
    named = {"type": "function", "function": {"name": "get_time"}}
    await post({"messages": ASK, "tools": TOOLS, "tool_choice": named}, engine)
    assert json.loads(engine.params.structured_outputs.json) == TIME
    await post({"messages": ASK, "tools": TOOLS, "tool_choice": "required"}, engine)
    schema = json.loads(engine.params.structured_outputs.json)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]


A_NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("body", "parsing", "param"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            AUTO,
            "tool_choice.function.name",
        ),
        ({"tool_choice": "sometimes"}, AUTO, "tool_choice"),
        ({}, ChatParsing(), "tool_choice"),  # auto without --enable-auto-tool-choice
        ({"parallel_tool_calls": False}, AUTO, "parallel_tool_calls"),
        ({"parallel_tool_calls": "no"}, AUTO, "parallel_tool_calls"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            AUTO,
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            AUTO,
            "tools[0].function.name",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, AUTO, "tools[1]"),
        ({"tools": [{"type": "retrieval"}]}, AUTO, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            AUTO,
            "tools[0].function.parameters",
        ),
        ({"tools": None, "tool_choice": "required"}, AUTO, "tool_choice"),
        ({"chat_template_kwargs": {"messages": []}}, AUTO, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": "x"}, AUTO, "chat_template_kwargs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, AUTO, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            AUTO,
            "messages[0].tool_calls[0]",
        ),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, AUTO, "messages[0].name"),
        ({"tool_choice": A_NAMED, "skip_special_tokens": True}, ChatParsing("mistral", True), None),
        ({"skip_special_tokens": True}, ChatParsing("mistral", True), "skip_special_tokens"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(body, parsing, param) -> None:
    engine = RecordingEngine(reply="{}")
    reply = await post({"messages": ASK, "tools": TOOLS, **body}, engine, parsing)
    if param is None:  # a named choice needs no parser markers: accepted
        assert reply.status_code == 200, reply.text
        return
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert not engine.requests  # refused before the engine saw it


def test_an_auto_choice_needs_a_parser_at_start_up() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatParsing(None, True)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ChatParsing("nonsense", True)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ChatParsing(reasoning_parser="nonsense")
