"""Incremental detokenization: token ids in, stable text deltas out."""

from __future__ import annotations

import os

from engine.text.tokenizer import Tokenizer

# Prompt tokens kept as decoding context for the first output token's leading space.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text deltas, O(window) per append.

    Built from our `Tokenizer` wrapper (not a raw transformers tokenizer: the wrapper
    caches the byte-fallback and special-id sets this class needs).

    Contract:
    - `append(ids)` returns the text delta those ids make final and adds it to
      `output_text`; `flush()` returns whatever is still held back (call it once the
      sequence finishes). Deltas from `append` then `flush` concatenate to
      `decode(prompt_ids + output_ids)[len(decode(prompt_ids)):]` with the same
      `skip_special_tokens`: with an empty prompt that is exactly `decode(output_ids)`;
      after a prompt, the first token's leading space is kept ("▁Hello" continues the
      prompt as " Hello"), as the whole text would read.
    - Text is held back, never emitted then corrected, while it may still change:
      while it ends in U+FFFD (an incomplete UTF-8 character from byte-level BPE) and
      while the last token is a byte-fallback piece (`<0xNN>`), because a byte-fallback
      decoder turns a whole run of byte pieces into U+FFFDs if any byte of the run is
      invalid; a run's text is final only when a non-byte token ends it.
    - Each append decodes only a window: the ids of the last emission (context for
      spacing; at first, the prompt's last PROMPT_CONTEXT_TOKENS ids) plus the ids not
      yet emitted. The context must decode to non-empty text, or a decoder that strips
      the text's first space would strip the new text's; so an empty-text context is
      kept and the window grows instead. Ids before the window are dropped.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.output_text = ""
        self._byte_ids = tokenizer.byte_fallback_ids
        # Skipped specials change nothing in a skipping decode, so they never enter the
        # window (a long run of them cannot grow it).
        self._skipped_ids = tokenizer.skipped_ids if skip_special_tokens else frozenset()
        tail = prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :]
        # The window: ids[:read_offset] are context (their text, `prefix_text`, is already
        # out or is the prompt's); ids[read_offset:] are not yet final.
        self._ids: list[int] = self._kept(tail)
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def append(self, new_token_ids: list[int]) -> str:
        """Add output token ids; return the text they make final (may be "")."""
        self._ids += self._kept(new_token_ids)
        if self._read_offset == len(self._ids) or self._ids[-1] in self._byte_ids:
            return ""
        text = self._decode(self._ids)
        if text.endswith(_REPLACEMENT):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emit the held-back text (the sequence ended; nothing can complete it now)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    def _kept(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i not in self._skipped_ids]

    def _emit(self, text: str) -> str:
        """Output the window text past the prefix; slide the window to the new ids."""
        prefix = self._prefix_text
        keep = len(prefix) if text.startswith(prefix) else len(os.path.commonprefix([prefix, text]))
        delta = text[keep:]
        # The new ids become the next context, unless their text alone is empty (then it
        # could not shield the next ids from start-of-text rules, so the window keeps more).
        tail_text = self._decode(self._ids[self._read_offset :])
        if tail_text:
            del self._ids[: self._read_offset]
            self._prefix_text = tail_text
        else:
            self._prefix_text = text
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
