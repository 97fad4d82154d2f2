"""Tokenizer loading, the wrapper's properties, chat templates and message validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import Tokenizer, load_tokenizer, validate_messages

SHARED = (Path(__file__).resolve().parents[2] / ".." / "shared").resolve()
STORIES = SHARED / "models" / "stories260K"
LLAMA2 = SHARED / "tokenizers" / "llama2"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_hf_tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    """A character-level tokenizer that adds BOS, built without any files."""
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz .!?\n")
    vocab = {p: i for i, p in enumerate(specials + chars)}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    rust.decoder = decoders.Fuse()
    rust.add_special_tokens(specials)
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = chat_template
    return hf


def need(path: Path) -> Path:
    if not path.is_dir():
        pytest.skip(f"{path} is absent (needs the shared folder beside the repo)")
    return path


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer(load_tokenizer(str(need(STORIES))))


# ---------------------------------------------------------------- loading
def test_load_from_a_saved_directory(tmp_path: Path) -> None:
    tiny_hf_tokenizer().save_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.decode(tok.encode("hi there")) == "hi there"
    assert tok.encode("hi")[0] == tok.bos_token_id == 1


def test_load_from_a_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files") as info:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_load_from_a_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ValueError, match="no such tokenizer directory") as info:
        load_tokenizer(str(missing))
    assert str(missing) in str(info.value)
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        load_tokenizer("not a valid hub id!")


@pytest.mark.shared
def test_shared_tokenizers_properties(stories: Tokenizer) -> None:
    assert stories.vocab_size == 512
    assert (stories.bos_token_id, stories.eos_token_id) == (1, 2)
    assert set(stories.all_special_ids) == {0, 1, 2}
    assert len(stories.byte_fallback_ids) == 256
    llama2 = Tokenizer(load_tokenizer(str(need(LLAMA2))))
    assert llama2.vocab_size == 32000
    assert (llama2.bos_token_id, llama2.eos_token_id) == (1, 2)


@pytest.mark.shared
def test_encode_decode_round_trip(stories: Tokenizer) -> None:
    ids = stories.encode("Once upon a time 😀")
    assert ids[0] == stories.bos_token_id
    assert stories.encode("Once", add_special_tokens=False)[0] != stories.bos_token_id
    assert stories.decode(ids) == "Once upon a time 😀"
    assert stories.decode(ids, skip_special_tokens=False).startswith("<s>")


# ---------------------------------------------------------------- chat templates
@pytest.mark.shared
def test_stories_chat_template_renders_one_bos(stories: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert stories.render_chat(messages) == "<s>Q: hi\nA:"
    ids = stories.apply_chat_template(messages)
    assert ids == stories.encode("<s>Q: hi\nA:", add_special_tokens=False)
    assert ids.count(stories.bos_token_id) == 1 and ids[0] == stories.bos_token_id
    reference = stories.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reference = reference["input_ids"] if not isinstance(reference, list) else reference
    assert ids == list(reference)


@pytest.mark.shared
def test_stories_chat_template_multi_turn(stories: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert stories.render_chat(messages) == "<s>Be kind.\nQ: hi\nA: hello\nQ: more\nA:"
    text = stories.render_chat(messages, add_generation_prompt=False)
    assert text == "<s>Be kind.\nQ: hi\nA: hello\nQ: more\n"
    ids = stories.apply_chat_template(messages, add_generation_prompt=False)
    assert (
        stories.decode(ids, skip_special_tokens=False) == "<s> Be kind.\nQ: hi\nA: hello\nQ: more\n"
    )


def test_template_without_bos_gets_the_bos_encode_adds() -> None:
    tok = Tokenizer(tiny_hf_tokenizer())
    assert tok.adds_bos
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == "<s><|user|>hi\n<|assistant|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.decode(ids, skip_special_tokens=False) == "<s><|user|>hi\n"


def test_template_with_bos_is_not_given_a_second_one() -> None:
    tok = Tokenizer(tiny_hf_tokenizer("{{ bos_token }}" + TEMPLATE))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_no_chat_template_is_a_clear_error() -> None:
    tok = Tokenizer(tiny_hf_tokenizer(chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- validation
OK = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hi", "non-empty list"),
        ([], "non-empty list"),
        ([OK, "hi"], r"messages\[1\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([OK, {"role": "bot", "content": "hi"}], r"messages\[1\]\.role is 'bot'"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]\.role is 3"),
        ([OK, OK, {"role": "user"}], r"messages\[2\] has no 'content'"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": ["hi"]}], r"messages\[0\]\.content must be a string"),
    ],
)
def test_bad_messages_name_index_and_field(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)
    with pytest.raises(ValueError, match=match):
        Tokenizer(tiny_hf_tokenizer()).apply_chat_template(messages)  # type: ignore[arg-type]


def test_all_roles_and_extra_keys_are_accepted() -> None:
    roles = ["system", "user", "assistant", "tool"]
    validate_messages([{"role": r, "content": "x", "name": "n"} for r in roles])


@pytest.mark.timeout(120)
def test_chat_template_option_replaces_the_tokenizers_own(tmp_path) -> None:
    from engine import LLM

    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for value in (template, str(path)):  # the text itself, or a file holding it
        llm = LLM("builtin:tiny", chat_template=value, kv_cache_memory=8 << 20)
        assert llm.get_tokenizer().render_chat([{"role": "user", "content": "hi"}]) == "[user]hi"
