"""Tool-call parsers (hermes, llama3_json, mistral): canned outputs give the expected
content and calls; malformed calls come out as content, never as an error; a stream fed
the same text in any chunks (one char at a time, seeded random cuts) gives the same
content and calls as the whole text, and its argument fragments add up to each call's
arguments."""

from __future__ import annotations

import json
import random
import re

import pytest

from engine.text.tool_parsers import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParserName,
    counting_call_ids,
    tool_parser,
)
from tests.engine.chunkings import cuttings

pytestmark = pytest.mark.timeout(120)

TRICKY_ARGS = {
    "query": 'a {b} [c] "quoted" } ]',
    "nested": {"list": [1, 2.5, {"deep": "}{"}], "flag": True, "none": None},
    "path": "C:\\temp\\new",
    "unicode": "naïve 日本語 🌧",
    "code": 'if x:\n    print("}")',
}
TRICKY_JSON = json.dumps(TRICKY_ARGS)  # ASCII escapes (\u65e5...) in the model's text
WEATHER = {"city": "Paris", "unit": "celsius"}


def _parser(name: str):
    return tool_parser(name, call_id=counting_call_ids())


def _calls(*pairs: tuple[str, dict]) -> list[ToolCall]:
    return [
        ToolCall(f"call_{i}", name, json.dumps(args, ensure_ascii=False))
        for i, (name, args) in enumerate(pairs)
    ]


def _hermes_block(name: str, args: dict | str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {json.dumps(args)}}}\n</tool_call>'


def _cuttings(text: str, seeds: int = 12) -> list[list[str]]:
    return cuttings(text, seeds, max_size=9)


def _streamed(name: str, pieces: list[str]) -> tuple[ParsedToolCalls, ParsedToolCalls]:
    """What the deltas add up to, and the stream's own result."""
    stream = _parser(name).stream()
    steps = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = "".join(step.content for step in steps)
    calls: list[dict] = []
    for delta in (d for step in steps for d in step.tool_calls):
        if delta.id is not None:
            assert delta.index == len(calls) and delta.name and delta.arguments == ""
            calls.append({"id": delta.id, "name": delta.name, "arguments": ""})
        else:
            assert delta.index == len(calls) - 1 and delta.name is None
            calls[delta.index]["arguments"] += delta.arguments
    added = [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls]
    return ParsedToolCalls(None if added and not content else content, added), stream.result()


def _check(name: str, text: str, content: str | None, calls: list[ToolCall]) -> None:
    """The whole text gives `content` and `calls`; so does every cutting of a stream."""
    assert _parser(name).parse(text) == ParsedToolCalls(content, calls)
    for pieces in _cuttings(text):
        added, result = _streamed(name, pieces)
        assert added == result == ParsedToolCalls(content, calls), pieces


# hermes ---------------------------------------------------------------------------


def test_hermes_one_call() -> None:
    text = _hermes_block("get_weather", WEATHER)
    _check("hermes", text, None, _calls(("get_weather", WEATHER)))


def test_hermes_several_calls_with_text_before() -> None:
    text = "I'll check both cities.\n\n" + _hermes_block("get_weather", WEATHER)
    text += "\n" + _hermes_block("get_weather", {"city": "Tōkyō"}) + "\n"
    calls = _calls(("get_weather", WEATHER), ("get_weather", {"city": "Tōkyō"}))
    _check("hermes", text, "I'll check both cities.\n\n", calls)


def test_hermes_tricky_arguments_round_trip() -> None:
    text = f'<tool_call>{{"name": "search", "arguments": {TRICKY_JSON}}}</tool_call>'
    _check("hermes", text, None, _calls(("search", TRICKY_ARGS)))
    assert json.loads(_parser("hermes").parse(text).tool_calls[0].arguments) == TRICKY_ARGS


def test_hermes_raw_newline_in_a_string_and_quoted_arguments() -> None:
    raw = '<tool_call>{"name": "run", "arguments": {"code": "a\nb"}}</tool_call>'
    _check("hermes", raw, None, _calls(("run", {"code": "a\nb"})))
    quoted = _hermes_block("add", json.dumps({"a": 1}))  # arguments as a JSON string
    _check("hermes", quoted, None, _calls(("add", {"a": 1})))


def test_hermes_no_arguments_and_text_between_and_after() -> None:
    text = '<tool_call>{"name": "now"}</tool_call> then <tool_call>{"name": "b", '
    text += '"arguments": null}</tool_call>\nDone.'
    _check("hermes", text, " then \nDone.", _calls(("now", {}), ("b", {})))


def test_hermes_plain_text_and_near_markers() -> None:
    for text in ["", "   \n", "Just an answer.", "a < b and <tool_ca", "</tool_call> <tool"]:
        _check("hermes", text, text, [])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',  # unterminated
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # invalid JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # not an object
        '<tool_call>{"name": "f", "arguments": {}, "parameters": {}}</tool_call>',  # both
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not JSON
        '<tool_call>["f", {}]</tool_call>',  # not an object
        "<tool_call></tool_call>",
        "<tool_call>",
    ],
)
def test_hermes_malformed_call_is_content(block: str) -> None:
    _check("hermes", "Sure. " + block, "Sure. " + block, [])


def test_hermes_malformed_block_beside_a_good_one() -> None:
    bad = '<tool_call>{"name": "f", "arguments": </tool_call>'
    text = bad + "\n" + _hermes_block("get_weather", WEATHER)
    _check("hermes", text, bad + "\n", _calls(("get_weather", WEATHER)))


# llama3_json ----------------------------------------------------------------------


def test_llama3_one_call_with_and_without_python_tag() -> None:
    body = f'{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}'
    for text in [body, "<|python_tag|>" + body, "\n " + body + "\n", "<|python_tag|> " + body]:
        _check("llama3_json", text, None, _calls(("get_weather", WEATHER)))


def test_llama3_several_calls() -> None:
    a = '{"name": "a", "parameters": {"x": 1}}'
    b = f'{{"name": "b", "arguments": {TRICKY_JSON}}}'
    calls = _calls(("a", {"x": 1}), ("b", TRICKY_ARGS))
    for text in [f"{a}; {b}", f"<|python_tag|>{a};{b};", f"{a}\n{b}", f"{a}; <|python_tag|>{b}"]:
        _check("llama3_json", text, None, calls)


def test_llama3_text_first_is_all_content() -> None:
    for text in ['Call it: {"name": "a", "parameters": {}}', "Hello!", "", " \n", "<|python"]:
        _check("llama3_json", text, text, [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "parameters": {"x": 1}',  # unterminated
        '{"name": "a", "parameters": {"x": 1]}',  # mismatched bracket
        '{"parameters": {}}',  # no name
        '{"name": "a", "parameters": {}, "arguments": {}}',  # both keys
        '<|python_tag|>print("hello")',  # the code-interpreter form is not a JSON call
        '{"name": "a", "parameters": 7}',
    ],
)
def test_llama3_malformed_first_call_is_all_content(text: str) -> None:
    _check("llama3_json", text, text, [])


def test_llama3_good_call_then_malformed_rest() -> None:
    good = '{"name": "a", "parameters": {}}'
    for rest in ['; {"name": "b", "parameters": {', "; {oops}", " and then some text", ";;"]:
        _check("llama3_json", good + rest, rest, _calls(("a", {})))


# mistral --------------------------------------------------------------------------


def test_mistral_list_form() -> None:
    one = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}]'
    _check("mistral", one, None, _calls(("get_weather", WEATHER)))
    two = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, '
    two += f'{{"name": "b", "arguments": {TRICKY_JSON}}}]'
    _check("mistral", "Checking. " + two, "Checking. ", _calls(("a", {}), ("b", TRICKY_ARGS)))


def test_mistral_named_form() -> None:
    text = (
        f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]search[ARGS]{TRICKY_JSON}"
    )
    _check("mistral", text, None, _calls(("get_weather", WEATHER), ("search", TRICKY_ARGS)))
    _check("mistral", 'Hi[TOOL_CALLS]f.v-2{"a": 1}', "Hi", _calls(("f.v-2", {"a": 1})))


@pytest.mark.parametrize(
    "block",
    [
        '[TOOL_CALLS][{"name": "a", "arguments": {}}',  # unterminated list
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}}]',  # one bad
        "[TOOL_CALLS][]",  # no call
        "[TOOL_CALLS][1, 2]",
        "[TOOL_CALLS]",
        "[TOOL_CALLS] ",
        "[TOOL_CALLS]get weather",  # not a name
        "[TOOL_CALLS]get_weather[ARGS]",  # no arguments
        '[TOOL_CALLS]get_weather[ARGS]{"city": ',  # unterminated arguments
        "[TOOL_CALLS]get_weather[ARGS][1]",  # arguments not an object
        '[TOOL_CALLS]{"a": 1}',  # no name
    ],
)
def test_mistral_malformed_block_is_content(block: str) -> None:
    _check("mistral", "Text " + block, "Text " + block, [])


def test_mistral_bad_block_then_good_one() -> None:
    text = '[TOOL_CALLS]bad name[TOOL_CALLS]ok[ARGS]{"a": [1]}'
    _check("mistral", text, "[TOOL_CALLS]bad name", _calls(("ok", {"a": [1]})))


def test_mistral_ids_and_special_tokens() -> None:
    parser = tool_parser("mistral")
    assert parser.needs_special_tokens
    ids = [c.id for c in parser.parse('[TOOL_CALLS][{"name": "a"}, {"name": "b"}]').tool_calls]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


# all formats ----------------------------------------------------------------------


def test_registry_uses_vllm_names_and_refuses_others() -> None:
    assert {n.value for n in ToolParserName} == {"hermes", "llama3_json", "mistral"}
    for name in ToolParserName:
        assert tool_parser(name).parse("plain").content == "plain"
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral"):
        tool_parser("hermes2")


def test_default_ids_look_like_openai_ones() -> None:
    calls = tool_parser("hermes").parse(_hermes_block("a", {}) + _hermes_block("b", {}))
    ids = [c.id for c in calls.tool_calls]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert not tool_parser("hermes").needs_special_tokens


def test_openai_shapes() -> None:
    call = ToolCall("call_0", "f", '{"a": 1}')
    assert call.to_openai() == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    first = ToolCallDelta(0, id="call_0", name="f").to_openai()
    assert first == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(0, arguments="{}").to_openai() == {
        "index": 0,
        "function": {"arguments": "{}"},
    }


def test_content_is_sent_early_and_a_marker_prefix_held() -> None:
    stream = _parser("hermes").stream()
    assert stream.feed("Hello <tool").content == "Hello "
    step = stream.feed("_call>")
    assert not step
    assert stream.feed('{"name": "f"}</tool_call>').tool_calls[0].name == "f"
    assert stream.feed("\n").content == ""  # whitespace after a call: held, then dropped
    assert not stream.finish()
    assert stream.finish() == stream.finish()  # finishing again gives nothing
    with pytest.raises(RuntimeError):
        stream.feed("more")


def test_a_malformed_block_is_released_when_it_fails() -> None:
    stream = _parser("hermes").stream()
    assert stream.feed("<tool_call>{not json").content == ""
    assert stream.feed("}</tool_call> ok").content == "<tool_call>{not json}</tool_call> ok"


def test_long_arguments_stream_in_small_pieces() -> None:
    args = {"text": 'x{y}"z" ' * 4000, "n": list(range(500))}
    text = f'<tool_call>{{"name": "write", "arguments": {json.dumps(args)}}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    added, _ = _streamed("hermes", pieces)
    assert added == ParsedToolCalls(None, _calls(("write", args)))
    mistral = f"[TOOL_CALLS]write[ARGS]{json.dumps(args)}"
    pieces = [mistral[i : i + 3] for i in range(0, len(mistral), 3)]
    assert _streamed("mistral", pieces)[0] == ParsedToolCalls(None, _calls(("write", args)))


_FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    '{"name": "f", "arguments": {"a": "}"}}',
    '{"name": "g", "parameters": {}}',
    '[{"name": "h", "arguments": {}}]',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ";",
    " ",
    "\n",
    "<",
    "text",
    "é",
    "name",
]


@pytest.mark.parametrize("name", list(ToolParserName))
def test_random_text_never_raises_and_any_cutting_agrees(name: str) -> None:
    rng = random.Random(f"tool-{name}")
    for _ in range(150):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(0, 14)))
        whole = _parser(name).parse(text)
        for pieces in _cuttings(text, seeds=3):
            added, result = _streamed(name, pieces)
            assert added == result == whole, (text, pieces)
        parsed_text = (whole.content or "") + "".join(c.name for c in whole.tool_calls)
        assert whole.tool_calls or whole.content == text, parsed_text
