"""A stream's choice chunks (the `choices` entries of SSE chunks), in order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.messages import OutputDelta
from engine.text.chat_output import ChatOutputStream
from web.chat_reply import ChatReplyShape, finish_reason, merged
from web.completion_echo import EchoGate, PromptEcho
from web.openai_format import (
    ChoiceTally,
    chat_logprobs,
    completion_logprobs,
    echo_entries,
    entries,
)


@dataclass(frozen=True)
class ChunkShape:
    """What a stream's chunks hold: chat or completions, the choices per prompt, the top
    logprobs asked for (None: no logprobs), whether echo puts the prompt's tokens
    first, and (chat) how each choice's text is split into content, reasoning and tool
    calls."""

    chat: bool
    choices_per_prompt: int
    top_logprobs: int | None
    echo_logprobs: bool
    reply: ChatReplyShape | None = None


class ChoiceChunks:
    """A stream's choice chunks, in order: the first of each choice opens the assistant
    turn (chat) or carries the echoed prompt (completions; with logprobs, once its
    prompt's logprob rows have come: EchoGate); completions' text offsets run on from
    chunk to chunk (kept in each choice's tally)."""

    def __init__(
        self,
        shape: ChunkShape,
        echoes: list[PromptEcho] | None,
        tallies: dict[int, ChoiceTally],
    ) -> None:
        self.shape, self.echoes, self.tallies = shape, echoes, tallies
        self.gate = EchoGate(shape.choices_per_prompt) if shape.echo_logprobs else None
        self.started: set[int] = set()
        self.splits: dict[int, ChatOutputStream] = {}  # chat: each choice's text split
        self.calling: set[int] = set()  # chat: choices that sent tool calls

    def ready(self, index: int, out: OutputDelta) -> Iterator[dict[str, Any]]:
        """The chunks that may go out now that choice `index` got `out` (none while its
        text is held back to be split, unless it carries logprobs or ends the choice)."""
        pairs = [(index, out)] if self.gate is None else self.gate.admit(index, out)
        for i, delta in pairs:
            chunk = self._chunk(i, delta)
            if chunk is not None:
                yield chunk

    def drain(self) -> Iterator[dict[str, Any]]:
        """Chunks still waiting when the stream ends."""
        for i, delta in self.gate.drain() if self.gate is not None else ():
            chunk = self._chunk(i, delta)
            if chunk is not None:
                yield chunk

    def _chunk(self, index: int, out: OutputDelta) -> dict[str, Any] | None:
        first = index not in self.started
        self.started.add(index)
        choice: dict[str, Any] = {"index": index}
        rows, top = out.logprobs or (), self.shape.top_logprobs
        reason = out.finish_reason
        if self.shape.chat:
            fields = self._chat_fields(index, out)
            if not (fields or first or rows or reason is not None):
                return None  # held back: nothing the client can use yet
            choice["delta"] = {"role": "assistant", **fields} if first else fields
            choice["logprobs"] = chat_logprobs(rows, top) if top is not None and rows else None
            reason = finish_reason(reason, index in self.calling)
        else:
            text, head = out.text, []
            if first and self.echoes is not None:
                p = index // self.shape.choices_per_prompt
                text = self.echoes[p].text + text
                if self.gate is not None:
                    head = echo_entries(self.echoes[p].first_token, self.gate.rows_of(p), top)
            choice["text"] = text
            choice["logprobs"] = None
            if top is not None and (rows or head):
                tally = self.tallies[index]
                lp = completion_logprobs([*head, *entries(rows, top)], tally.text_offset)
                tally.text_offset += sum(map(len, lp["tokens"]))
                choice["logprobs"] = lp
        choice["finish_reason"] = reason
        if out.finish_reason is not None:
            choice["stop_reason"] = out.stop_reason
        return choice

    def _chat_fields(self, index: int, out: OutputDelta) -> dict[str, Any]:
        """The delta's fields for choice `index`: its text as it came (no split), or
        what the split lets out now (all of it at the choice's end)."""
        reply = self.shape.reply
        if reply is None or reply.plain:
            return {"content": out.text}
        split = self.splits.setdefault(index, reply.format.stream())
        parts = split.feed(out.text)
        if out.finish_reason is not None:
            parts = merged(parts, split.finish())
        if parts.tool_calls:
            self.calling.add(index)
        return reply.delta(parts) if parts else {}
