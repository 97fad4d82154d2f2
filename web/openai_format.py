"""OpenAI response shapes: choices tallied from engine deltas, logprobs, usage, SSE lines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.messages import LogprobRow, OutputDelta


@dataclass
class ChoiceTally:
    """One choice as its deltas arrive: text, logprob rows, the final delta, and the
    latest token counts (a request-wide abort carries none of its own)."""

    texts: list[str] = field(default_factory=list)
    rows: list[LogprobRow] = field(default_factory=list)
    prompt_rows: list[LogprobRow] = field(default_factory=list)  # when this choice got them
    final: OutputDelta | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    text_offset: int = 0  # a stream's: where its next logprob token starts in the text

    def add(self, out: OutputDelta) -> None:
        self.texts.append(out.text)
        self.rows.extend(out.logprobs or ())
        self.prompt_rows.extend(out.prompt_logprobs or ())
        if out.num_prompt_tokens or out.num_output_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
            self.num_output_tokens = out.num_output_tokens
        if out.finish_reason is not None:
            self.final = out

    @property
    def text(self) -> str:
        return "".join(self.texts)


def usage(tallies: dict[int, ChoiceTally], choices_per_prompt: int) -> dict[str, int]:
    """Completion tokens summed over the choices; prompt tokens over the prompts, each
    counted once however many choices it has (choice `i` is of prompt
    `i // choices_per_prompt`), as OpenAI counts them."""
    per_prompt: dict[int, int] = {}
    for index, tally in tallies.items():
        p = index // choices_per_prompt
        per_prompt[p] = max(per_prompt.get(p, 0), tally.num_prompt_tokens)
    prompt = sum(per_prompt.values())
    completion = sum(t.num_output_tokens for t in tallies.values())
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


# One completions logprob entry: the token's text, its logprob, its top alternatives
# (logprob and top are None for an echoed prompt's first token, which nothing predicts).
Entry = tuple[str, float | None, dict[str, float] | None]


def chat_logprobs(rows: Sequence[LogprobRow], k: int) -> dict:
    return {"content": [_chat_logprob(row, _top(row, k)) for row in rows]}


def completion_logprobs(entries: Sequence[Entry], start: int = 0) -> dict:
    """Completions logprobs: each token's text (the text it adds, so they join into the
    choice's text), logprob, top alternatives, and where it starts in the choice's text
    (`text_offset`, counted from `start`, as OpenAI does: the running length of the
    tokens before it)."""
    offsets, at = [], start
    for token, _, _ in entries:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": [token for token, _, _ in entries],
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [top for _, _, top in entries],
        "text_offset": offsets,
    }


def entries(rows: Sequence[LogprobRow], k: int) -> list[Entry]:
    """Completions entries of logprob rows (the chosen token first in each row)."""
    return [(row[0].decoded_token or "", row[0].logprob, _top_map(row, k)) for row in rows]


def _top_map(row: LogprobRow, k: int) -> dict[str, float]:
    return {c.decoded_token: c.logprob for c in _top(row, k)}


def echo_entries(first_token: str, prompt_rows: Sequence[LogprobRow], k: int) -> list[Entry]:
    """An echoed prompt's entries: its first token (null logprob, as OpenAI gives it),
    then one per scored prompt position."""
    return [(first_token, None, None), *entries(prompt_rows, k)]


def _top(row: LogprobRow, k: int) -> list:
    """The row's top-k candidates by rank (the sampled token may rank below them)."""
    return sorted((c for c in row if c.rank is not None and c.rank <= k), key=lambda c: c.rank)


def _chat_logprob(row: LogprobRow, top: list) -> dict[str, Any]:
    def entry(c) -> dict[str, Any]:
        token = c.decoded_token or ""
        return {"token": token, "logprob": c.logprob, "bytes": list(token.encode("utf-8"))}

    return {**entry(row[0]), "top_logprobs": [entry(c) for c in top]}


# Characters that JSON leaves raw but `str.splitlines` (and so httpx's `aiter_lines`)
# treats as line breaks: a generated U+2028 would cut an event in two for such clients.
_LINE_BREAKS_JSON_KEEPS = str.maketrans(
    {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event: a single `data:` line that every line splitter keeps whole."""
    data = json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)
    return f"data: {data}\n\n"
