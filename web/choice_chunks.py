"""A stream's choice chunks (the `choices` entries of SSE chunks), in order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.messages import OutputDelta
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
    logprobs asked for (None: no logprobs), and whether echo puts the prompt's tokens
    first."""

    chat: bool
    choices_per_prompt: int
    top_logprobs: int | None
    echo_logprobs: bool


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

    def ready(self, index: int, out: OutputDelta) -> Iterator[dict[str, Any]]:
        """The chunks that may go out now that choice `index` got `out`."""
        pairs = [(index, out)] if self.gate is None else self.gate.admit(index, out)
        for i, delta in pairs:
            yield self._chunk(i, delta)

    def drain(self) -> Iterator[dict[str, Any]]:
        """Chunks still waiting when the stream ends."""
        for i, delta in self.gate.drain() if self.gate is not None else ():
            yield self._chunk(i, delta)

    def _chunk(self, index: int, out: OutputDelta) -> dict[str, Any]:
        first = index not in self.started
        self.started.add(index)
        choice: dict[str, Any] = {"index": index}
        rows, top = out.logprobs or (), self.shape.top_logprobs
        if self.shape.chat:
            content = {"content": out.text}
            choice["delta"] = {"role": "assistant", **content} if first else content
            choice["logprobs"] = chat_logprobs(rows, top) if top is not None and rows else None
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
        choice["finish_reason"] = out.finish_reason
        if out.finish_reason is not None:
            choice["stop_reason"] = out.stop_reason
        return choice
