"""Reasoning in a model's output (`<think>...</think>`), as vLLM's `--reasoning-parser`
separates it: OpenAI-style `reasoning_content` apart from `content`.

Pick a behaviour by name (`reasoning_parser("qwen3")`, names in `ReasoningParserName`);
`parse(text)` splits a whole output, `stream()` follows one output delta by delta. Both
give the same split for the same text, however the stream was cut; markers split across
deltas are held back until decided. Never raises on any text. Pure text logic: never
imports torch (tests/engine/test_layout.py checks)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum, auto
from typing import NamedTuple

from engine.text.tool_parsers.marker_prefix import is_marker_prefix, partial_marker_len

START = "<think>"
END = "</think>"


class ReasoningParserName(StrEnum):
    """How an output's reasoning is found, named as vLLM names it.

    - `deepseek_r1`: the output starts inside reasoning (DeepSeek-R1's template ends the
      prompt with `<think>\\n`); a `<think>` opening the output is skipped. Reasoning
      runs to the first `</think>`; without one, the whole output is reasoning.
    - `qwen3`: reasoning only when the output opens with `<think>` (Qwen3 writes it
      itself; with `enable_thinking=False` it writes none and the output is content).
      vLLM's first qwen3 parser; its newer one starts inside reasoning as deepseek_r1
      does, for templates that put `<think>` in the prompt (Qwen3-Thinking-2507,
      Qwen3.5): pass `in_reasoning=parser.begins_in_reasoning(prompt)` for those.
    In both, a `<think>` opening the output may follow whitespace (dropped with it).
    Unlike vLLM's whole-text parsers, a `<think>` elsewhere is text, and an unclosed
    `<think>` under qwen3 leaves reasoning (vLLM's stream) rather than content (its
    whole-text mode), so that both modes agree."""

    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"


class ParsedReasoning(NamedTuple):
    """A whole output split. `reasoning_content` is None when the output has no
    reasoning part; `content` is None when it has one and nothing follows `</think>`."""

    reasoning_content: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningDelta:
    """What one stream step gives the client; either part may be empty."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class _Phase(Enum):
    LEAD = auto()  # the output's start: whitespace and maybe a `<think>` being written
    REASONING = auto()
    CONTENT = auto()


class ReasoningStream:
    """One output, fed in deltas: `feed(delta)` returns the reasoning and content that
    text decides (a possible prefix of `<think>` at the start, or of `</think>` inside
    reasoning, is held until decided); `finish()` returns the rest (again: empty);
    `feed` after it raises RuntimeError. `result()` after `finish()` equals the parser's
    `parse` of the same text. Markers are never emitted."""

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning  # where the output starts, without a `<think>`
        self._phase = _Phase.LEAD
        self._buffer = ""
        self._had_reasoning = in_reasoning
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    def feed(self, delta: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("ReasoningStream.feed after finish(); start a new stream()")
        self._buffer += delta
        return self._record(self._drain(final=False))

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._record(self._drain(final=True))

    def result(self) -> ParsedReasoning:
        """The split of the whole output (call after `finish`)."""
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        if not self._had_reasoning:
            return ParsedReasoning(None, content)
        return ParsedReasoning(reasoning, content or None)

    def _drain(self, final: bool) -> ReasoningDelta:
        if self._phase is _Phase.LEAD and not self._lead(final):
            return ReasoningDelta()
        if self._phase is _Phase.REASONING:
            end = self._buffer.find(END)
            if end < 0:
                keep = 0 if final else partial_marker_len(self._buffer, END)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return ReasoningDelta(reasoning=reasoning)
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
            self._phase = _Phase.CONTENT
            return ReasoningDelta(reasoning, self._take())
        return ReasoningDelta(content=self._take())

    def _lead(self, final: bool) -> bool:
        """Decide how the output opens; False while it cannot be told yet."""
        opening = self._buffer.lstrip()
        if opening.startswith(START):
            self._buffer = opening[len(START) :]
            self._phase, self._had_reasoning = _Phase.REASONING, True
            return True
        if not final and (not opening or is_marker_prefix(opening, START)):
            return False
        self._phase = _Phase.REASONING if self._in_reasoning else _Phase.CONTENT
        return True

    def _take(self) -> str:
        text, self._buffer = self._buffer, ""
        return text

    def _record(self, delta: ReasoningDelta) -> ReasoningDelta:
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.content:
            self._content.append(delta.content)
        return delta


class ReasoningParser:
    """One `--reasoning-parser` behaviour (see `ReasoningParserName`). Holds no
    per-output state: build one per server, call `parse` per finished output or
    `stream()` once per streamed output (each choice needs its own stream).

    `in_reasoning` overrides where an output without an opening `<think>` starts: True
    inside reasoning, False in content; None takes the name's rule."""

    def __init__(self, name: ReasoningParserName) -> None:
        self.name = name

    def begins_in_reasoning(self, prompt: str | None = None) -> bool:
        """Where an output starts after `prompt`: inside reasoning when the prompt
        (trailing whitespace aside) ends with `<think>`, in content when it ends with
        `</think>` (thinking turned off), else by the name's rule."""
        tail = (prompt or "").rstrip()
        if tail.endswith(START):
            return True
        if tail.endswith(END):
            return False
        return self.name is ReasoningParserName.DEEPSEEK_R1

    def stream(self, in_reasoning: bool | None = None) -> ReasoningStream:
        """A fresh stream for one output."""
        return ReasoningStream(self.begins_in_reasoning() if in_reasoning is None else in_reasoning)

    def parse(self, text: str, in_reasoning: bool | None = None) -> ParsedReasoning:
        """`(reasoning_content, content)` of a whole output: exactly what a stream fed
        the same text in any chunks adds up to."""
        stream = self.stream(in_reasoning)
        stream.feed(text)
        stream.finish()
        return stream.result()


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser for `name` (a `ReasoningParserName` or its string). An unknown name
    raises ValueError naming the choices."""
    try:
        return ReasoningParser(ReasoningParserName(name))
    except ValueError:
        choices = ", ".join(ReasoningParserName)
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {choices} (--reasoning-parser)"
        ) from None
