"""A chat choice's output split into reasoning, content and tool calls, in every
tool_choice mode: a stream fed the text in any chunks (whole, one char at a time, seeded
random cuts) adds up to `parse` of the whole text; forced calls (named, required) stream
their arguments as generated, and a cut or malformed forced output never raises."""

from __future__ import annotations

import json
import random

import pytest

from engine.text.chat_output import ChatDelta, ChatOutputFormat, ChatReply, ToolChoiceMode
from engine.text.reasoning_parser import reasoning_parser
from engine.text.tool_parsers import ToolCall, ToolCallDelta, counting_call_ids, tool_parser
from tests.engine.chunkings import cuttings

pytestmark = pytest.mark.timeout(120)

NONE, AUTO = ToolChoiceMode.NONE, ToolChoiceMode.AUTO
REQUIRED, NAMED = ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED

TRICKY = {
    "q": 'a "}" ]',
    "nested": {"list": [1, 2.5, {"deep": "}{[]"}], "flag": True, "none": None},
    "path": "C:\\temp\\new",
    "unicode": "naïve 日本語 🌧",
    "code": 'if x:\n    print("}")',
}


def _format(mode: ToolChoiceMode = NONE, **kwargs) -> ChatOutputFormat:
    return ChatOutputFormat(tool_mode=mode, call_id=counting_call_ids(), **kwargs)


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _array(*calls: tuple[str, dict], dump=_compact) -> str:
    return dump([{"name": name, "parameters": args} for name, args in calls])


def _calls(*calls: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]


def _added(steps: list[ChatDelta]) -> tuple[str, str, list[ToolCall]]:
    """The reasoning, content and calls that stream steps add up to; checks each call
    delta's shape (a first delta with id and name, then non-empty fragments)."""
    calls: list[dict] = []
    for delta in (d for step in steps for d in step.tool_calls):
        if delta.id is not None:
            assert delta.index == len(calls) and delta.name and delta.arguments == ""
            calls.append({"id": delta.id, "name": delta.name, "arguments": ""})
        else:
            assert delta.index == len(calls) - 1 and delta.name is None and delta.arguments
            calls[delta.index]["arguments"] += delta.arguments
    reasoning = "".join(step.reasoning for step in steps)
    content = "".join(step.content for step in steps)
    return reasoning, content, [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls]


def _streamed(output: ChatOutputFormat, pieces: list[str]) -> ChatReply:
    """Feeds `pieces`; checks the steps add up to the stream's result; returns it."""
    stream = output.stream()
    steps = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    result = stream.result()
    assert _added(steps) == (result[0] or "", result[1] or "", result[2]), pieces
    assert stream.finish() == ChatDelta()
    return result


def _check(output: ChatOutputFormat, text: str, expected: ChatReply, seeds: int = 12) -> None:
    """The whole text gives `expected`; so does every cutting of a stream."""
    assert output.parse(text) == expected
    for pieces in cuttings(text, seeds, max_size=9):
        assert _streamed(output, pieces) == expected, pieces


# none -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["", " \n", "Hello!", "<think>a</think>b", '<tool_call>{"name": "f"}</tool_call>']
)
def test_none_is_identity(text: str) -> None:
    _check(_format(NONE), text, ChatReply(None, text, []))
    stream = _format(NONE, tool_parser=tool_parser("hermes")).stream()  # parser ignored
    assert [stream.feed(c) for c in text] == [ChatDelta(content=c) for c in text]


def test_none_with_reasoning() -> None:
    qwen3 = reasoning_parser("qwen3")
    _check(
        _format(NONE, reasoning=qwen3),
        "<think>\nPlan.\n</think>Answer.",
        ChatReply("\nPlan.\n", "Answer.", []),
    )
    _check(
        _format(NONE, reasoning=qwen3),
        "<think>all thought</think>",
        ChatReply("all thought", None, []),
    )
    _check(_format(NONE, reasoning=qwen3), "No thinking.", ChatReply(None, "No thinking.", []))
    _check(
        _format(NONE, reasoning=qwen3, in_reasoning=True),
        "Plan.</think>Answer.",
        ChatReply("Plan.", "Answer.", []),
    )


# auto -------------------------------------------------------------------------------


def test_auto_hermes_calls_come_whole() -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text += "\n</tool_call>"
    expected = ChatReply(None, "Checking.\n", _calls(("get_weather", '{"city": "Paris"}')))
    _check(_format(AUTO, tool_parser=tool_parser("hermes", counting_call_ids())), text, expected)


def test_auto_with_reasoning_before_a_call() -> None:
    text = '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
    text += '"arguments": {"city": "Paris"}}\n</tool_call>'
    output = _format(
        AUTO,
        tool_parser=tool_parser("hermes", counting_call_ids()),
        reasoning=reasoning_parser("qwen3"),
    )
    calls = _calls(("get_weather", '{"city": "Paris"}'))
    _check(output, text, ChatReply("\nNeed the weather.\n", None, calls))
    thought = "<think>A <tool_call> here is thought.</think>Plain answer."
    _check(output, thought, ChatReply("A <tool_call> here is thought.", "Plain answer.", []))
    _check(output, "<think>cut off", ChatReply("cut off", None, []))


# named ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [json.dumps(TRICKY), _compact(TRICKY), '{"q":"a \\"}\\" ]"}', "{}", "", '{"city": "Par'],
)
def test_named_arguments_stream_as_generated(arguments: str) -> None:
    expected = ChatReply(None, None, _calls(("get_weather", arguments)))
    _check(_format(NAMED, function_name="get_weather"), arguments, expected)


def test_named_sends_its_first_delta_once_on_the_first_feed() -> None:
    stream = _format(NAMED, function_name="f").stream()
    assert stream.feed("") == ChatDelta(tool_calls=(ToolCallDelta(0, id="call_0", name="f"),))
    assert stream.feed("") == ChatDelta()
    assert stream.feed('{"a"') == ChatDelta(tool_calls=(ToolCallDelta(0, '{"a"'),))
    assert stream.feed(": 1}") == ChatDelta(tool_calls=(ToolCallDelta(0, ": 1}"),))
    assert stream.finish() == ChatDelta()
    assert stream.result() == ChatReply(None, None, _calls(("f", '{"a": 1}')))
    unfed = _format(NAMED, function_name="f").stream()
    assert unfed.finish().tool_calls == (ToolCallDelta(0, id="call_0", name="f"),)
    assert unfed.result() == ChatReply(None, None, _calls(("f", "")))


# required ---------------------------------------------------------------------------

THREE = (("get_weather", {"city": "Paris"}), ("search", TRICKY), ("now", {}))


def test_required_one_call() -> None:
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    expected = ChatReply(None, None, _calls(("get_weather", '{"city":"Paris"}')))
    _check(_format(REQUIRED), text, expected)


def _indented(value) -> str:
    return " \n" + json.dumps(value, indent=2) + "\n"


def _nested_indent(value) -> str:
    """A value's text inside `_indented`'s array: two levels deeper."""
    return json.dumps(value, indent=2).replace("\n", "\n    ")


@pytest.mark.parametrize(
    ("dump", "written"),
    [(_compact, _compact), (json.dumps, json.dumps), (_indented, _nested_indent)],
)
def test_required_three_calls(dump, written) -> None:
    expected = ChatReply(None, None, _calls(*((name, written(args)) for name, args in THREE)))
    _check(_format(REQUIRED), _array(*THREE, dump=dump), expected)
    assert [json.loads(c.arguments) for c in expected.tool_calls] == [a for _, a in THREE]


def test_required_one_fragment_per_feed_per_call() -> None:
    text = _array(*THREE)
    step = _format(REQUIRED).stream().feed(text)
    fragments = [d.arguments for d in step.tool_calls if d.id is None]
    assert [(d.index, d.name) for d in step.tool_calls if d.id] == [
        (0, "get_weather"),
        (1, "search"),
        (2, "now"),
    ]
    assert fragments == [_compact(args) for _, args in THREE]


def test_required_escaped_quotes_and_brackets_in_strings() -> None:
    value = '{"q":"a \\"}\\" ]","r":["[{\\\\",{"s":"\\u00e9"}]}'
    assert json.loads(value)["q"] == 'a "}" ]'
    text = f'[{{"name":"f","parameters":{value}}},{{"name":"g","parameters":{{}}}}]'
    _check(_format(REQUIRED), text, ChatReply(None, None, _calls(("f", value), ("g", "{}"))))


def test_required_escaped_name_is_decoded() -> None:
    text = '[{"name":"get\\u005fweather","parameters":{}}]'
    _check(_format(REQUIRED), text, ChatReply(None, None, _calls(("get_weather", "{}"))))


def test_required_cut_anywhere_never_raises() -> None:
    """Every prefix (a length cut) gives the calls whose names were complete, each with
    a prefix of its arguments; a prefix before the first name is content."""
    text = _array(*THREE)
    full = _calls(*((name, _compact(args)) for name, args in THREE))
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        reply = _format(REQUIRED).parse(prefix)
        named = sum(f'"name":"{name}"' in prefix for name, _ in THREE)
        assert reply.content == (None if reply.tool_calls else prefix)
        assert len(reply.tool_calls) == named
        for call, whole in zip(reply.tool_calls, full, strict=False):
            assert (call.id, call.name) == (whole.id, whole.name)
            assert whole.arguments.startswith(call.arguments)
        for pieces in cuttings(prefix, seeds=1):
            assert _streamed(_format(REQUIRED), pieces) == reply, pieces
    mid_name = text[: text.index('"search"') + 4]
    assert _format(REQUIRED).parse(mid_name) == ChatReply(None, None, full[:1])
    mid_params = text[: text.index('"nested"') + 3]
    cut_args = _compact(TRICKY)[: _compact(TRICKY).index('"nested"') + 3]
    assert _format(REQUIRED).parse(mid_params).tool_calls == [
        full[0],
        ToolCall("call_1", "search", cut_args),
    ]


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("Sure! Here is the weather.", []),
        ('{"name":"f","parameters":{}}', []),  # not an array
        ('[{"name":"","parameters":{}}]', []),  # empty name
        ('[{"parameters":{},"name":"f"}]', []),  # keys in the other order
        ('[{"name":"f","arguments":{"a":1}}]', [("f", "")]),  # wrong key after the name
        ('[{"name":"f","parameters":[1]}]', [("f", "")]),  # parameters not an object
        ('[{"name":"f","parameters":{"a":[1}]}]', [("f", '{"a":[1')]),  # mismatched bracket
        ('[{"name":"f","parameters":{}}] and text', [("f", "{}")]),  # text after the array
        ('[{"name":"f","parameters":{}};{"name":"g"', [("f", "{}")]),  # bad separator
        ('[{"na me":"f","parameters":{}}]', []),
    ],
)
def test_required_malformed_stops_at_the_divergence(text: str, calls: list) -> None:
    expected = ChatReply(None, text if not calls else None, _calls(*calls))
    _check(_format(REQUIRED), text, expected, seeds=4)


def test_required_random_parameters_round_trip() -> None:
    rng = random.Random("required")
    atoms = ['"', "\\", "}", "{", "]", "[", ",", ":", " ", "\n", "é", "🌧", "a"]

    def value(depth: int):
        kind = rng.randrange(4 if depth < 3 else 2)
        if kind == 0:
            return "".join(rng.choice(atoms) for _ in range(rng.randint(0, 6)))
        if kind == 1:
            return rng.choice([0, -1.5, True, None])
        if kind == 2:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(30):
        calls = [(f"f{i}", {"x": value(0)}) for i in range(rng.randint(1, 3))]
        for dump in (_compact, json.dumps):
            args = [dump(a) for _, a in calls]
            expected = ChatReply(None, None, _calls(*zip([n for n, _ in calls], args, strict=True)))
            _check(_format(REQUIRED), _array(*calls, dump=dump), expected, seeds=3)


# reasoning is not applied to forced calls ---------------------------------------------


def test_reasoning_is_not_applied_in_forced_modes() -> None:
    r1 = reasoning_parser("deepseek_r1")  # would take a whole output without </think>
    named = _format(NAMED, function_name="f", reasoning=r1)
    _check(named, '{"a": 1}', ChatReply(None, None, _calls(("f", '{"a": 1}'))))
    required = _format(REQUIRED, reasoning=r1, in_reasoning=True)
    _check(required, _array(("f", {})), ChatReply(None, None, _calls(("f", "{}"))))
    thought = "<think>hm</think>" + _array(("f", {}))
    _check(required, thought, ChatReply(None, thought, []))


# the stream's lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize("mode", list(ToolChoiceMode))
def test_feed_after_finish_raises_and_finish_twice_is_empty(mode: ToolChoiceMode) -> None:
    output = _format(mode, tool_parser=tool_parser("hermes"), function_name="f")
    stream = output.stream()
    with pytest.raises(RuntimeError):
        stream.result()
    stream.feed("[")
    stream.finish()
    assert stream.finish() == ChatDelta()
    with pytest.raises(RuntimeError):
        stream.feed("x")
    assert stream.result() == output.parse("[")


def test_missing_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOutputFormat(tool_mode=AUTO)
    with pytest.raises(ValueError, match="function's name"):
        ChatOutputFormat(tool_mode=NAMED)
    assert ChatOutputFormat(tool_mode="required").tool_mode is REQUIRED


def test_chat_delta_truth() -> None:
    assert not ChatDelta()
    assert ChatDelta(reasoning="a") and ChatDelta(content="b")
    assert ChatDelta(tool_calls=(ToolCallDelta(0, "x"),))
