"""IncrementalDetokenizer: deltas are final text, concatenating to the whole decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer
from tests.engine.tiny_tokenizers import byte_level, sentencepiece_like

SHARED = (Path(__file__).resolve().parents[2] / ".." / "shared").resolve()
FFFD = "\ufffd"
TEXTS = [
    "Hello 😀 world",
    "café naïve résumé",
    "世界 and 日本語のテキスト",
    "the family 👩‍👩‍👧 is here! 🎉🎉",
    "a\n\nb  c   d.",
    "hi",
]
WORDS = ["hi", "the", "hello", "café", "😀", "世界", "é", "a", "\n", "tea", "!", "👩‍👧"]


# ---------------------------------------------------------------- tokenizers under test
# (the tiny in-test ones are in tests/engine/tiny_tokenizers.py)
def shared_tokenizer(relative: str) -> Tokenizer:
    path = SHARED / relative
    if not path.is_dir():
        pytest.skip(f"{path} is absent (needs the shared folder beside the repo)")
    return Tokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    return sentencepiece_like()


@pytest.fixture(scope="module")
def bl_tok() -> Tokenizer:
    return byte_level()


@pytest.fixture(
    scope="module",
    params=[
        "sentencepiece_like",
        "byte_level",
        pytest.param("stories260K", marks=pytest.mark.shared),
        pytest.param("llama2", marks=pytest.mark.shared),
    ],
)
def any_tok(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "sentencepiece_like":
        return sentencepiece_like()
    if request.param == "byte_level":
        return byte_level()
    if request.param == "stories260K":
        return shared_tokenizer("models/stories260K")
    return shared_tokenizer("tokenizers/llama2")


# ---------------------------------------------------------------- helpers
def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None):
    """Append `ids` in chunks (one token each, or random 1-4 sized); return the deltas."""
    deltas, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4) if rng else 1
        deltas.append(detok.append(ids[i : i + size]))
        i += size
        assert "".join(deltas) == detok.output_text
    return deltas


def expected(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """What the output adds to the prompt's text (== decode(output) for an empty prompt)."""
    if not prompt:
        return tok.decode(output, skip_special_tokens=skip)
    whole = tok.decode(prompt + output, skip_special_tokens=skip)
    before = tok.decode(prompt, skip_special_tokens=skip)
    assert whole.startswith(before)
    return whole[len(before) :]


def random_output(tok: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """Random ids biased toward the hard cases: byte pieces, specials, real characters."""
    bytes_ = sorted(tok.byte_fallback_ids)
    specials = tok.all_special_ids
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.3 and bytes_:
            ids.append(rng.choice(bytes_))
        elif kind < 0.4:
            ids.append(rng.choice(specials))
        elif kind < 0.7:
            ids += tok.encode(rng.choice(WORDS), add_special_tokens=False)
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids


def random_prompt(tok: Tokenizer, rng: random.Random) -> list[int]:
    """A real prompt ending in a whole character (so the output cannot merge into it)."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 6))] + ["ok"]
    return tok.encode(" ".join(words))


# ---------------------------------------------------------------- tests
def test_byte_fallback_character_is_held_until_its_run_ends(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hi 😀 the", add_special_tokens=False)
    assert len(ids) == 7  # ▁hi ▁ <0xF0> <0x9F> <0x98> <0x80> ▁the
    deltas = stream(IncrementalDetokenizer(sp_tok, []), ids)
    assert deltas == ["hi", " ", "", "", "", "", "😀 the"]


def test_byte_fallback_run_at_the_end_comes_out_on_flush(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hi 世", add_special_tokens=False) + [sp_tok.eos_token_id]
    detok = IncrementalDetokenizer(sp_tok, [])
    deltas = stream(detok, ids)
    assert all(FFFD not in d for d in deltas)
    assert detok.output_text == "hi "
    assert detok.flush() == "世"
    assert detok.output_text == "hi 世"
    assert detok.flush() == ""


def test_stray_byte_turns_the_whole_run_into_replacement_chars(sp_tok: Tokenizer) -> None:
    emoji = sp_tok.encode("😀", add_special_tokens=False)[1:]
    stray = sp_tok.hf_tokenizer.convert_tokens_to_ids("<0x80>")
    ids = emoji + [stray] + sp_tok.encode("hi", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp_tok, [])
    text = "".join(stream(detok, ids))
    assert text == sp_tok.decode(ids) == FFFD * 5 + " hi"


def test_byte_level_character_comes_out_when_complete(bl_tok: Tokenizer) -> None:
    ids = bl_tok.encode("a😀b")
    assert len(ids) == 6
    deltas = stream(IncrementalDetokenizer(bl_tok, []), ids)
    assert deltas == ["a", "", "", "", "😀", "b"]


def test_prompt_gives_the_first_token_its_leading_space(sp_tok: Tokenizer) -> None:
    out = sp_tok.encode("hello", add_special_tokens=False)  # ▁hello
    assert "".join(stream(IncrementalDetokenizer(sp_tok, []), out)) == "hello"
    prompt = sp_tok.encode("hi")
    assert "".join(stream(IncrementalDetokenizer(sp_tok, prompt), out)) == " hello"
    only_bos = IncrementalDetokenizer(sp_tok, [sp_tok.bos_token_id])
    assert "".join(stream(only_bos, out)) == "hello"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(sp_tok: Tokenizer, skip: bool) -> None:
    hi = sp_tok.encode("hi", add_special_tokens=False)
    ids = hi + [sp_tok.eos_token_id] + hi
    detok = IncrementalDetokenizer(sp_tok, [], skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == ("hi hi" if skip else "hi</s> hi")
    assert text == sp_tok.decode(ids, skip_special_tokens=skip)


def test_leading_skipped_special_does_not_eat_a_space(sp_tok: Tokenizer) -> None:
    hi = sp_tok.encode("hi", add_special_tokens=False)
    ids = hi + [sp_tok.eos_token_id, sp_tok.eos_token_id] + hi + hi
    for step in range(1, 4):
        detok = IncrementalDetokenizer(sp_tok, [])
        for i in range(0, len(ids), step):
            detok.append(ids[i : i + step])
        assert detok.output_text == sp_tok.decode(ids) == "hi hi hi"


def test_real_texts_stream_without_replacement_chars(any_tok: Tokenizer) -> None:
    for text in TEXTS:
        out = any_tok.encode(text, add_special_tokens=False)
        for prompt in ([], any_tok.encode("Q: hi")):
            detok = IncrementalDetokenizer(any_tok, prompt)
            deltas = stream(detok, out) + [detok.flush()]
            assert all(FFFD not in d for d in deltas)
            assert "".join(deltas) == expected(any_tok, prompt, out, True)
            assert "".join(deltas).strip() == text.strip()


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_the_whole_decode(any_tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    for trial in range(300):
        output = random_output(any_tok, rng, rng.randint(0, 60))
        prompt = random_prompt(any_tok, rng) if trial % 2 else []
        detok = IncrementalDetokenizer(any_tok, prompt, skip_special_tokens=skip)
        text = "".join(stream(detok, output, rng)) + detok.flush()
        assert text == detok.output_text
        assert text == expected(any_tok, prompt, output, skip), (prompt, output)


class _SpyTokenizer(Tokenizer):
    """Records the longest id list decoded, to check the window stays small."""

    longest = 0

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens, spaces_between_special_tokens)


def test_each_append_decodes_a_bounded_window(sp_tok: Tokenizer) -> None:
    spy = _SpyTokenizer(sp_tok.hf_tokenizer)
    prompt = spy.encode("the " * 100)
    out = spy.encode("hi hello the 😀 café " * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(spy, prompt)
    stream(detok, out)
    assert len(out) > 400 and spy.longest <= 16
    assert detok.output_text == expected(spy, prompt, out, True)
