"""The xgrammar backend: compiles constraints for one vocabulary, matches sequences."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
import xgrammar as xgr

from engine.structured_outputs import (
    ConstraintKind,
    StructuredOutputsError,
    StructuredOutputsParams,
)
from engine.worker.grammar.schema_fixes import bounded_strings_as_patterns

MAX_REASON_CHARS = 400  # of xgrammar's message, quoted in the error a client sees


class XGrammarMatcher:
    """`GrammarMatcher` over an `xgrammar.GrammarMatcher`."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend:
    """`GrammarBackend` on xgrammar, for `hf_tokenizer`'s vocabulary padded (or cut) to
    the model's `vocab_size`, ending on `stop_token_ids` (the model's end tokens).

    How each constraint compiles: `json` (through `schema_fixes`) with `any_whitespace =
    not disable_any_whitespace` and xgrammar's strict mode (objects take no properties
    beyond those the schema names unless it says `additionalProperties`, as vLLM's
    xgrammar backend does; `disable_additional_properties` asks for exactly that);
    `json_object` as any JSON object; `choice` as a grammar of its strings;
    `grammar` as EBNF; `structural_tag` as xgrammar reads it, or in the older form
    vLLM also takes (`structures` of begin/schema/end, `triggers`). The compiler keeps no
    cache of its own (`GrammarCache` is the one cache)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        max_threads: int | None = None,
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        threads = max_threads or compile_threads()
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        try:
            return self._compile(kind, params)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, ...
            reason = " ".join(str(exc).split())[:MAX_REASON_CHARS] or type(exc).__name__
            raise StructuredOutputsError(
                f"structured_outputs.{kind.value} cannot be compiled: {reason}"
            ) from None

    def _compile(self, kind: ConstraintKind, params: StructuredOutputsParams):
        compiler = self._compiler
        if kind == ConstraintKind.JSON:
            return compiler.compile_json_schema(
                bounded_strings_as_patterns(params.json),
                any_whitespace=not params.disable_any_whitespace,
                strict_mode=True,
            )
        if kind == ConstraintKind.JSON_OBJECT:
            return compiler.compile_json_schema(
                '{"type": "object"}',
                any_whitespace=not params.disable_any_whitespace,
                strict_mode=False,
            )
        if kind == ConstraintKind.REGEX:
            return compiler.compile_regex(params.regex)
        if kind == ConstraintKind.CHOICE:
            return compiler.compile_grammar(choice_grammar(params.choice))
        if kind == ConstraintKind.GRAMMAR:
            return compiler.compile_grammar(params.grammar)
        return _compile_structural_tag(compiler, params.structural_tag)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)  # [B, cdiv(V, 32)]

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # logits: [B, V] float32; bitmask: [B, cdiv(V, 32)] int32 on the logits' device
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


def compile_threads() -> int:
    """Threads one compile may use: at most half the cores (at least 1, at most 4).
    A compile runs beside the batch's forward pass (in the worker, and in the tokenizer
    process checking it), so every extra compile thread takes a core from the running
    requests: on 2 cores, 4 threads per compile let an unseen schema stall the batch
    1.08 s and 1 thread 0.47 s, while the compile itself takes 2.0 s instead of 1.0 s
    (docs/structured_outputs.md)."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of `choices` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile_structural_tag(compiler: xgr.GrammarCompiler, text: str) -> xgr.CompiledGrammar:
    """xgrammar's structural tag, or vLLM's older `{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`."""
    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    try:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"structures must be objects with begin, schema and end, beside triggers ({exc!r})"
        ) from None
    return compiler.compile_structural_tag(items, triggers)
