"""Structured outputs on every surface: OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*` fields, the WebSocket protocol and the SDK.

In-process, around a recording engine: what each spelling hands the engine, and the
400s (named by the field the client sent) for malformed values and conflicts. End to
end on the built-in model: the served reply is JSON that validates against its schema
(this needs the engine's grammar masks)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError
from starlette.testclient import TestClient

from engine.structured_outputs import StructuredOutputsParams
from tests.web.recording_engine import MODEL, RecordingEngine, recording_app
from tests.web.sdk_stub import StubServer, answer_control, finish
from web.client import AsyncClient, InvalidRequestError

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
STRICT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Answer yes or no."}]
ROUTES = {
    "chat/completions": {"messages": MESSAGES, "max_tokens": 4},
    "completions": {"prompt": "Answer yes or no:", "max_tokens": 4},
}


def _openai(engine: RecordingEngine) -> AsyncOpenAI:
    transport = httpx.ASGITransport(app=recording_app(engine))
    http = httpx.AsyncClient(transport=transport, base_url="http://recorded", timeout=30)
    return AsyncOpenAI(
        base_url="http://recorded/v1", api_key="none", http_client=http, max_retries=0
    )


async def _post(engine: RecordingEngine, route: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=recording_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://recorded") as http:
        return await http.post(f"/v1/{route}", json=body, timeout=30)


# -- what reaches the engine ------------------------------------------------------------
async def test_response_format_json_schema_reaches_the_engine_as_its_schema() -> None:
    """As vLLM: the schema is the constraint; `strict: true` does not add
    disable_additional_properties (a strict schema says additionalProperties itself)."""
    engine = RecordingEngine(reply='{"answer":"yes"}')
    want = StructuredOutputsParams(json=SCHEMA)
    async with _openai(engine) as api:
        out = await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=8, response_format=STRICT
        )
        assert out.choices[0].message.content == '{"answer":"yes"}'
        assert engine.params.structured_outputs == want
        assert json.loads(engine.params.structured_outputs.json) == SCHEMA
        await api.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=8, extra_body={"response_format": STRICT}
        )
        assert engine.params.structured_outputs == want
        stream = await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=JSON_SCHEMA, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == '{"answer":"yes"}'
        assert engine.params.structured_outputs == want


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}},
            StructuredOutputsParams(choice=("yes", "no"), disable_any_whitespace=True),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"', "json": None}},
            StructuredOutputsParams(grammar='root ::= "a"'),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"))),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        (
            {"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"},
            StructuredOutputsParams(regex="[0-9]+"),
        ),
        (  # options alone ride on the constraint another field sets, as in vLLM
            {
                "response_format": JSON_SCHEMA,
                "structured_outputs": {
                    "disable_any_whitespace": True,
                    "disable_additional_properties": True,
                },
            },
            StructuredOutputsParams(
                json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True
            ),
        ),
        ({"guided_json": None, "structured_outputs": None, "response_format": None}, None),
    ],
)
@pytest.mark.parametrize("route", ROUTES)
async def test_each_spelling_reaches_the_engine(route: str, extra: dict, want) -> None:
    engine = RecordingEngine()
    reply = await _post(engine, route, {**ROUTES[route], **extra})
    assert reply.status_code == 200, reply.text
    assert engine.params.structured_outputs == want


# -- refusals name the field ----------------------------------------------------------------
def _schema_with(**changes) -> dict:
    spec = {"name": "answer", "schema": SCHEMA, **changes}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v != ...}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": _schema_with(schema=...)}, "response_format.json_schema.schema"),
        ({"response_format": _schema_with(schema=[1])}, "response_format.json_schema.schema"),
        ({"response_format": _schema_with(name=...)}, "response_format.json_schema.name"),
        ({"response_format": _schema_with(strict="yes")}, "response_format.json_schema.strict"),
        ({"response_format": _schema_with(extra=1)}, "response_format.json_schema.extra"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": 7}, "guided_grammar"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"structural_tag": "{}"}, "structural_tag"),
        # the engine's refusal, in the client's spelling
        (
            {"response_format": {"type": "json_object"}, "use_beam_search": True, "n": 2},
            "response_format",
        ),
    ],
)
@pytest.mark.parametrize("route", ROUTES)
async def test_malformed_or_conflicting_is_a_400_naming_the_field(
    route: str, extra: dict, param: str
) -> None:
    engine = RecordingEngine()
    body = {**ROUTES[route], "temperature": 0, **extra}
    reply = await _post(engine, route, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_request"), error
    assert param in error["message"]
    assert engine.requests == []  # refused before the engine


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
        {"structured_outputs": {"regex": "a"}, "response_format": JSON_SCHEMA},
        {"guided_regex": "a", "guided_choice": ["b"]},
        {"structured_outputs": {"choice": ["a"]}, "guided_grammar": 'root ::= "a"'},
    ],
)
async def test_two_constraints_are_refused_naming_both(extra: dict) -> None:
    reply = await _post(
        RecordingEngine(), "chat/completions", {**ROUTES["chat/completions"], **extra}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert all(name in error["message"] for name in extra), error
    assert error["param"] == list(extra)[1]


@pytest.mark.parametrize(
    ("extra", "refusal", "param"),
    [
        (
            {"response_format": JSON_SCHEMA},
            "structured_outputs.json is not a schema xgrammar compiles: bad $ref",
            "response_format.json_schema.schema",
        ),
        (
            {"guided_regex": "(a"},
            "structured_outputs.regex does not compile: missing )",
            "guided_regex",
        ),
        (
            {"structured_outputs": {"grammar": "root ::="}},
            "structured_outputs.grammar does not compile: expected an expression",
            "structured_outputs.grammar",
        ),
        (
            {"guided_grammar": "root ::="},
            "invalid request: structured_outputs.grammar does not compile",
            "guided_grammar",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_engines_refusal_names_the_field_as_sent(
    extra: dict, refusal: str, param: str, stream: bool
) -> None:
    """The grammar compiler refuses a schema, regex or grammar later, in the engine, in
    its own words (`structured_outputs.<field>`): the 400 names the client's field."""
    engine = RecordingEngine(refusal=refusal)
    body = {**ROUTES["chat/completions"], "stream": stream, **extra}
    reply = await _post(engine, "chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


async def test_the_openai_client_sees_a_bad_request_naming_the_field() -> None:
    async with _openai(RecordingEngine()) as api:
        with pytest.raises(BadRequestError) as refused:
            await api.chat.completions.create(
                model=MODEL, messages=MESSAGES, response_format={"type": "xml"}
            )
    assert refused.value.body["param"] == "response_format.type"


# -- the WebSocket protocol and the SDK ----------------------------------------------------
def test_ws_generate_takes_structured_outputs() -> None:
    engine = RecordingEngine(reply="yes")
    with TestClient(recording_app(engine)) as client, client.websocket_connect("/v1/stream") as ws:
        params = {"max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}
        ws.send_json({"type": "generate", "id": "a", "prompt": "yes or no?", "params": params})
        events = [ws.receive_json(), ws.receive_json()]
        assert [e["type"] for e in events] == ["delta", "done"], events
        assert engine.params.structured_outputs == StructuredOutputsParams(choice=("yes", "no"))
        bad = {"structured_outputs": {"choice": "yes"}}
        ws.send_json({"type": "generate", "id": "b", "prompt": "x", "params": bad})
        error = ws.receive_json()
        assert (error["type"], error["id"], error["param"]) == (
            "error",
            "b",
            "structured_outputs.choice",
        )
        # the WebSocket takes vLLM's spelling only
        for other in ({"guided_choice": ["a"]}, {"response_format": {"type": "json_object"}}):
            ws.send_json({"type": "generate", "id": "c", "prompt": "x", "params": other})
            error = ws.receive_json()
            assert (error["type"], error["param"]) == ("error", next(iter(other))), error
    assert len(engine.requests) == 1


async def test_sdk_passes_structured_outputs_as_a_sampling_field() -> None:
    async def script(stub, ws, frame) -> None:
        if not await answer_control(ws, frame) and frame["type"] == "generate":
            await finish(ws, frame["id"], '{"a":1}')

    constraint = {"json": {"type": "object"}, "disable_any_whitespace": True}
    async with StubServer(script) as stub, AsyncClient(stub.url, timeout=10) as client:
        async for _ in client.stream("hi", max_tokens=4, structured_outputs=constraint):
            pass
        await client.complete("hi", structured_outputs={"json_object": True})
        chat = client.chat_session()
        await chat.send("hi", structured_outputs={"choice": ["a", "b"]}).collect()
    sent = [f["params"]["structured_outputs"] for f in stub.of_type("generate")]
    assert sent == [constraint, {"json_object": True}, {"choice": ["a", "b"]}]


async def test_sdk_against_a_server(builtin_server) -> None:
    async with AsyncClient(builtin_server.ws, timeout=60) as client:
        done = await client.complete(
            "hi", max_tokens=4, temperature=0, structured_outputs={"choice": ["yes", "no"]}
        )
        assert done.finish_reason in ("stop", "length")
        with pytest.raises(InvalidRequestError) as refused:
            await client.complete("hi", structured_outputs={"regex": ""})
        assert refused.value.param == "structured_outputs.regex"


# -- end to end ------------------------------------------------------------------------------
async def test_served_json_validates_against_its_schema(builtin_server) -> None:
    """The built-in model's weights are random: only the grammar mask makes its reply
    this schema's JSON (no optional whitespace, so greedy decoding cannot wander)."""
    async with AsyncOpenAI(base_url=f"{builtin_server.http}/v1", api_key="-", timeout=60) as api:
        out = await api.chat.completions.create(
            model=builtin_server.model,
            messages=MESSAGES,
            max_completion_tokens=64,
            temperature=0,
            response_format=STRICT,
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        )
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        (
            {
                "response_format": {
                    **JSON_SCHEMA,
                    "json_schema": {"name": "x", "schema": {"$ref": "#/no"}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_constraint_the_compiler_refuses_is_a_400_as_sent(builtin_server, extra, param) -> None:
    body = {**ROUTES["chat/completions"], **extra}
    reply = httpx.post(f"{builtin_server.http}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_request"), error
    assert error["message"].startswith(param), error
