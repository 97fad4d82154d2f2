"""TokenTexts: each token's text as it reads after other text, so a sequence's logprob
token strings join back into its text (a SentencePiece piece decoded alone loses its
leading space: ',', 'there', 'was')."""

from __future__ import annotations

import pytest

from engine.text.token_text import TokenTexts
from tests.engine.tiny_tokenizers import byte_level, sentencepiece_like

TEXTS = ["hello there", "the hello.", "hi hi hi!", "a\nthe"]  # plain ASCII: see TokenTexts


@pytest.mark.parametrize("make", [sentencepiece_like, byte_level], ids=["sp", "byte"])
@pytest.mark.parametrize("text", TEXTS)
def test_token_texts_join_into_the_text(make, text: str) -> None:
    tokenizer = make()
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    joined = "".join(texts(i) for i in ids)
    # SentencePiece reads the text's first piece with its space ("▁hello"): " hello"
    assert joined == text or joined == " " + text


def test_a_piece_keeps_its_leading_space_where_decoding_alone_drops_it() -> None:
    tokenizer = sentencepiece_like()
    texts = TokenTexts(tokenizer)
    (the,) = tokenizer.encode("the", add_special_tokens=False)[-1:]
    assert tokenizer.decode([the], skip_special_tokens=False) == "the"  # the bug
    assert texts(the) == " the"


def test_special_tokens_keep_their_text_and_answers_are_cached() -> None:
    tokenizer = sentencepiece_like()
    texts = TokenTexts(tokenizer)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 2
    assert texts(eos) == tokenizer.decode([eos], skip_special_tokens=False)
    assert texts(eos) is texts(eos)
