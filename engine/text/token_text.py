"""The text one token adds to the text before it: logprob token strings and /tokenize's
`token_strs`."""

from __future__ import annotations

from engine.text.tokenizer import Tokenizer


class TokenTexts:
    """Token id -> the text that token adds when it follows other text (cached).

    Decoding a token alone loses what a decoder does at the start of a text: SentencePiece
    drops the first piece's leading space, so "▁there" alone decodes to "there" and a
    completion's token strings would not join back into its text. So each token is
    decoded after a fixed anchor token, and the anchor's own text is cut off: " there".
    The strings of plain text's tokens then join into that text. Special tokens keep their
    text ("</s>"). A byte-fallback piece of a multi-byte character reads U+FFFD alone, as
    it does in every decoder. If a decoder's clean-up merges the token into the anchor
    (the anchor's text is then no prefix), the token is decoded alone.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_text = self._decode(self._anchor)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._text_of(token_id)
        return text

    def _text_of(self, token_id: int) -> str:
        if self._anchor_text:
            text = self._decode([*self._anchor, token_id])
            if text.startswith(self._anchor_text):
                return text[len(self._anchor_text) :]
        return self._decode([token_id])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
