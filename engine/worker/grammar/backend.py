"""The grammar backend seam: compile a constraint, match a sequence, mask logits.

A backend is bound to one vocabulary (the model's width, `vocab_size`, which may exceed
the tokenizer's length) and one set of stop tokens (the model's end-of-sequence ids).
Bitmasks have ONE format whatever the backend (xgrammar's and llguidance's): int32
`[batch, cdiv(vocab_size, 32)]`, bit `j` of word `w` set when token `32 * w + j` is
allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams

if TYPE_CHECKING:
    from torch import Tensor

    from engine.text.tokenizer import Tokenizer

CompiledGrammar = Any  # a backend's own compiled form; only that backend reads it


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar. After the grammar is complete it allows
    only stop tokens; accepting one terminates it, and a terminated matcher accepts
    nothing more."""

    def accept(self, token_id: int) -> bool:
        """Advances over `token_id`; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Writes the tokens allowed next into `bitmask[row]` (a CPU bitmask)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens."""
        ...

    @property
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    """Compiles constraints for one vocabulary and applies bitmasks to logits.

    `compile` raises `StructuredOutputsError` naming the constraint's field
    (`structured_outputs.json`, ...) and the backend's reason when it cannot compile
    (a syntax error, a schema feature it does not support)."""

    vocab_size: int

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar: ...

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher: ...

    def allocate_bitmask(self, batch_size: int) -> Tensor:
        """A CPU bitmask of `batch_size` rows, every token allowed."""
        ...

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
        """Sets to -inf, in place, the logits of `rows` that their bitmask rows forbid
        (`logits`: [B, V] float32, `bitmask` on its device, [B, cdiv(V, 32)])."""
        ...


def build_backend(
    tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: frozenset[int]
) -> GrammarBackend:
    """The backend for this engine's tokenizer and model (xgrammar, imported here: the
    first structured request pays for it, not the engine's start). Structured outputs
    need the vocabulary's text and an end token: without them, StructuredOutputsError."""
    if tokenizer is None:
        raise StructuredOutputsError(
            "structured_outputs needs the tokenizer, and this engine has none "
            "(skip_tokenizer_init); start it with its tokenizer"
        )
    if not stop_token_ids:
        raise StructuredOutputsError(
            "structured_outputs needs an end-of-sequence token to end the output when the "
            "grammar is complete, and this model declares none (eos_token_id)"
        )
    from engine.worker.grammar.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer.hf_tokenizer, vocab_size, stop_token_ids)
