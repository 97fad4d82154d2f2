"""Reasoning parsers (deepseek_r1, qwen3): canned outputs split into reasoning and
content as each name's rule says; a stream fed the same text in any chunks (one char at
a time, seeded random cuts, markers split anywhere) adds up to the whole-text split and
never emits a marker; the content can feed a tool-call parser."""

from __future__ import annotations

import random

import pytest

from engine.text.reasoning_parser import (
    ParsedReasoning,
    ReasoningDelta,
    ReasoningParserName,
    reasoning_parser,
)
from engine.text.tool_parsers import counting_call_ids, tool_parser
from tests.engine.chunkings import cuttings

pytestmark = pytest.mark.timeout(60)

R1, QWEN3 = "deepseek_r1", "qwen3"

CASES = [
    # (text, deepseek_r1 split, qwen3 split)
    (
        "<think>\nPlan.\n</think>\n\nAnswer.",
        ("\nPlan.\n", "\n\nAnswer."),
        ("\nPlan.\n", "\n\nAnswer."),
    ),
    ("Plan.</think>Answer.", ("Plan.", "Answer."), (None, "Plan.</think>Answer.")),
    ("Just an answer.", ("Just an answer.", None), (None, "Just an answer.")),
    ("<think>cut off mid-tho", ("cut off mid-tho", None), ("cut off mid-tho", None)),
    ("\n  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("<think></think>", ("", None), ("", None)),
    ("", ("", None), (None, "")),
    (" \n", (" \n", None), (None, " \n")),
    ("<thin", ("<thin", None), (None, "<thin")),
    (
        "<think>a</think>b</think>c<think>d",
        ("a", "b</think>c<think>d"),
        ("a", "b</think>c<think>d"),
    ),
    ("x <think>y</think>z", ("x <think>y", "z"), (None, "x <think>y</think>z")),
    (
        "<think>数学 🧮 </thin k></think>答え",
        ("数学 🧮 </thin k>", "答え"),
        ("数学 🧮 </thin k>", "答え"),
    ),
]


def _cuttings(text: str, seeds: int = 12) -> list[list[str]]:
    return cuttings(text, seeds, max_size=6)


def _streamed(name: str, pieces: list[str], in_reasoning: bool | None = None):
    stream = reasoning_parser(name).stream(in_reasoning)
    steps = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    reasoning = "".join(s.reasoning for s in steps)
    content = "".join(s.content for s in steps)
    return reasoning, content, stream.result()


def _check(name: str, text: str, expected: tuple, in_reasoning: bool | None = None) -> None:
    parser = reasoning_parser(name)
    assert parser.parse(text, in_reasoning) == ParsedReasoning(*expected)
    for pieces in _cuttings(text):
        reasoning, content, result = _streamed(name, pieces, in_reasoning)
        assert result == ParsedReasoning(*expected), pieces
        assert reasoning == (expected[0] or "") and content == (expected[1] or ""), pieces


@pytest.mark.parametrize(("text", "r1", "qwen3"), CASES)
def test_canned_outputs_split_the_same_whole_and_streamed(text, r1, qwen3) -> None:
    _check(R1, text, r1)
    _check(QWEN3, text, qwen3)


def test_in_reasoning_overrides_the_names_rule() -> None:
    _check(QWEN3, "Plan.</think>Answer.", ("Plan.", "Answer."), in_reasoning=True)
    _check(R1, "Answer.", (None, "Answer."), in_reasoning=False)
    _check(R1, "<think>a</think>b", ("a", "b"), in_reasoning=False)  # an opening tag still opens


def test_where_an_output_begins_follows_the_prompt() -> None:
    qwen3, r1 = reasoning_parser(QWEN3), reasoning_parser(R1)
    assert qwen3.begins_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.begins_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.begins_in_reasoning("<|im_start|>assistant\n")
    assert not qwen3.begins_in_reasoning()
    assert r1.begins_in_reasoning("<｜Assistant｜>")
    assert not r1.begins_in_reasoning("<think>\n\n</think>")


def test_markers_are_held_until_decided() -> None:
    stream = reasoning_parser(QWEN3).stream()
    assert stream.feed(" <th") == ReasoningDelta()
    assert stream.feed("ink>Let me") == ReasoningDelta(reasoning="Let me")
    assert stream.feed(" see</th") == ReasoningDelta(reasoning=" see")
    assert stream.feed("ink>\n\nIt is 4.") == ReasoningDelta("", "\n\nIt is 4.")
    assert stream.finish() == ReasoningDelta()
    assert stream.finish() == ReasoningDelta()
    with pytest.raises(RuntimeError):
        stream.feed("x")
    held = reasoning_parser(R1).stream()
    assert held.feed("a </") == ReasoningDelta(reasoning="a ")
    assert held.finish() == ReasoningDelta(reasoning="</")  # never closed: reasoning


def test_names_and_unknown_name() -> None:
    assert {n.value for n in ReasoningParserName} == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        reasoning_parser("r1")


_FRAGMENTS = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "é"]


@pytest.mark.parametrize("name", list(ReasoningParserName))
def test_random_text_any_cutting_agrees(name: str) -> None:
    rng = random.Random(f"reasoning-{name}")
    for _ in range(200):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(0, 12)))
        whole = reasoning_parser(name).parse(text)
        for pieces in _cuttings(text, seeds=3):
            assert _streamed(name, pieces)[2] == whole, (text, pieces)
        kept = (whole.reasoning_content or "") + (whole.content or "")
        assert len(kept) <= len(text)  # markers dropped, nothing invented


def test_content_feeds_a_tool_parser() -> None:
    """Qwen3 thinks, then calls a tool: reasoning first, the calls from the content."""
    text = '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
    text += '"arguments": {"city": "Paris"}}\n</tool_call>'
    for pieces in _cuttings(text, seeds=4):
        thinking = reasoning_parser(QWEN3).stream()
        calls = tool_parser("hermes", call_id=counting_call_ids()).stream()
        reasoning = []
        for piece in [*pieces, None]:
            step = thinking.feed(piece) if piece is not None else thinking.finish()
            reasoning.append(step.reasoning)
            calls.feed(step.content)
        calls.finish()
        assert "".join(reasoning) == "\nNeed the weather.\n"
        content, found = calls.result()
        assert content is None
        assert [(c.id, c.name, c.arguments) for c in found] == [
            ("call_0", "get_weather", '{"city": "Paris"}')
        ]
