"""Completions' `echo`: the prompt's text before each choice's text and, with logprobs,
the prompt's tokens before the choice's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from actors.engine_client import EngineClient
from engine.messages import LogprobRow, OutputDelta, PromptInput
from web.errors import ApiError, invalid


@dataclass(frozen=True)
class PromptEcho:
    """What echo puts before each choice of one prompt: the prompt's text (a text prompt
    as sent; token ids decoded like the choices' text) and, when logprobs are asked for,
    its first token's text (the entry with a null logprob: nothing predicts it)."""

    text: str
    first_token: str | None


async def prompt_echoes(
    engine: EngineClient, prompts: list[PromptInput], with_logprobs: bool, skip_special: bool
) -> list[PromptEcho]:
    """One PromptEcho per prompt (the tokenizer is asked only for what it must say);
    token ids are decoded as the choices' text is (`skip_special`: the request's
    skip_special_tokens)."""
    echoes = []
    for prompt in prompts:
        if isinstance(prompt, str) and not with_logprobs:
            echoes.append(PromptEcho(prompt, None))
            continue
        try:
            if isinstance(prompt, str):
                result = await engine.tokenize(prompt)
            else:
                result = await engine.detokenize(prompt, skip_special_tokens=skip_special)
        except ValueError as exc:
            raise invalid(f"prompt (echo): {exc}", "prompt") from None
        except RuntimeError as exc:
            raise ApiError("unavailable", f"the engine is not healthy: {exc}") from None
        text = prompt if isinstance(prompt, str) else result.text
        first = result.token_strs[0] if with_logprobs and result.token_strs else None
        echoes.append(PromptEcho(text, first))
    return echoes


@dataclass
class EchoGate:
    """Orders a stream's deltas for echo with logprobs. A choice's first chunk carries
    its prompt's logprob rows, which come with ONE choice's first delta (the sequence
    that scored the prompt); until they have come, the deltas of that prompt's other
    choices wait, in order. `rows_of(p)` then gives prompt p's rows."""

    choices_per_prompt: int
    rows: dict[int, tuple[LogprobRow, ...]] = field(default_factory=dict)
    waiting: dict[int, list[tuple[int, OutputDelta]]] = field(default_factory=dict)

    def admit(self, index: int, out: OutputDelta) -> Iterator[tuple[int, OutputDelta]]:
        """The (choice index, delta) pairs that may go out now, in order."""
        p = index // self.choices_per_prompt
        if out.prompt_logprobs and p not in self.rows:
            self.rows[p] = out.prompt_logprobs
        if p not in self.rows:
            self.waiting.setdefault(p, []).append((index, out))
            return
        yield from self.waiting.pop(p, ())
        yield index, out

    def drain(self) -> Iterator[tuple[int, OutputDelta]]:
        """What still waits at the end of the stream (the request ended before its
        prompt was scored: an abort); those chunks go out without prompt rows."""
        for p in sorted(self.waiting):
            yield from self.waiting.pop(p)

    def rows_of(self, prompt_index: int) -> tuple[LogprobRow, ...]:
        return self.rows.get(prompt_index, ())
