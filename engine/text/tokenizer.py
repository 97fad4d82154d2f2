"""Text <-> token ids: loading a Hugging Face tokenizer and the thin `Tokenizer` wrapper.

The wrapper is the one object the tokenizer actor and the detokenizer talk to; it hides
transformers' return-type quirks (`apply_chat_template` returns a `BatchEncoding` in
transformers 5) and validates chat messages before they reach a Jinja template.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2

from engine.text.chat_template import ChatRenderer, ChatTemplate, InlineRenderer
from engine.text.text_checks import check_text

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Any of these in a directory means "there is a tokenizer to load here".
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
)
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Around added-token text that came from message content: Unicode noncharacters, which
# no text needs, stripped from content first so a message cannot forge a mark.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_MARKED = re.compile(f"{_OPEN}([^{_OPEN}{_CLOSE}]*){_CLOSE}")


def load_tokenizer(
    name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> Any:
    """Load a transformers tokenizer from a local directory or a hub id.

    Raises ValueError naming the path when a local directory holds no tokenizer files,
    and when transformers cannot load it (a hub id without a network, a typo, ...).
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if not path.exists() and (path.is_absolute() or name_or_path.startswith((".", "~"))):
        raise ValueError(f"no such tokenizer directory: {name_or_path!r}")
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer files in {str(path)!r} (looked for {', '.join(_TOKENIZER_FILES)}); "
            "pass the model directory that holds tokenizer.json or tokenizer.model, "
            "or set a separate tokenizer path"
        )
    try:
        return AutoTokenizer.from_pretrained(
            str(path) if path.is_dir() else name_or_path,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {name_or_path!r}: {exc}. Check the path, or "
            "that the hub id exists and this machine can reach the hub"
        ) from exc


def validate_messages(messages: Any) -> None:
    """Raise ValueError naming the bad index and field unless `messages` is a non-empty
    list of dicts with `"role"` in CHAT_ROLES and a string `"content"` of valid Unicode
    (other keys pass)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"messages[{i}] has no 'role' field")
        role = message["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role is {role!r}; use one of {', '.join(CHAT_ROLES)}")
        if "content" not in message:
            raise ValueError(f"messages[{i}] has no 'content' field")
        content = message["content"]
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string, got {type(content).__name__}"
            )
        check_text(f"messages[{i}].content", content)


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, or the template text itself
    (as vLLM takes it). Raises ValueError naming the option when neither parses."""
    if value is None:
        return None
    path = Path(value).expanduser()
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path:
        if not path.is_file():
            raise ValueError(f"chat_template: no such file {value!r} (and it is not a template)")
        value = path.read_text()
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse as Jinja: {exc}") from None
    return value


class Tokenizer:
    """A thin wrapper over one transformers tokenizer (`hf_tokenizer`).

    Contract:
    - `encode` / `decode` are the tokenizer's own, with plain `list[int]` / `str` types.
    - `apply_chat_template` renders the template to text (`render_chat`), then encodes it
      (`encode_chat`) with `add_special_tokens=False`, so a template that writes
      `{{ bos_token }}` does not get a second BOS. BOS rule: if the rendered text does not
      start with the BOS string and this tokenizer adds BOS when encoding plain text, BOS
      is prepended, so chat prompts start exactly like `encode()` prompts do.
    - Messages are validated first (`validate_messages`); a tokenizer without a chat
      template raises ValueError. `chat_template`, when given, replaces the tokenizer's.
    - Rendering goes through `renderer` (an `InlineRenderer` unless the owner swaps in
      another, e.g. one in a child process); every failure is a ChatTemplateError.
    - No forged turns: text in message content that spells one of the tokenizer's added
      tokens (`<|im_end|>`, ...) is encoded as text, not as that token, unless
      `parse_special_tokens_in_content`.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        chat_template: str | None = None,
        parse_special_tokens_in_content: bool = False,
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.template_from_option = chat_template is not None
        if chat_template is not None:
            hf_tokenizer.chat_template = chat_template
        self.parse_special_tokens_in_content = parse_special_tokens_in_content
        template = self.chat_template
        self.renderer: ChatRenderer | None = None if template is None else InlineRenderer(template)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False
    ) -> Tokenizer:
        return cls(
            load_tokenizer(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
        )

    @property
    def name_or_path(self) -> str:
        return str(getattr(self.hf_tokenizer, "name_or_path", "") or "<in-memory tokenizer>")

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The template `render_chat` uses, with the special tokens it sees; None without
        one. Named for errors by where it came from, never by a path."""
        source = getattr(self.hf_tokenizer, "chat_template", None)
        if isinstance(source, dict):  # named templates: the default one
            source = source.get("default")
        if not isinstance(source, str):
            return None
        if self.template_from_option:
            name = "the chat template given by --chat-template"
        else:
            name = f"the chat template of {Path(self.name_or_path).name or 'this model'}"
        variables = {
            key: value
            for key, value in self.hf_tokenizer.special_tokens_map.items()
            if isinstance(value, (str, list))
        }
        return ChatTemplate(source, name, variables)

    @property
    def vocab_size(self) -> int:
        """All ids the tokenizer can produce, added tokens included."""
        return len(self.hf_tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_tokenizer.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf_tokenizer.all_special_ids)

    @cached_property
    def skipped_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens flagged
        special (what the Rust tokenizer skips), else the special-token attributes."""
        added = getattr(self.hf_tokenizer, "added_tokens_decoder", None)
        if not added:
            return frozenset(self.all_special_ids)
        return frozenset(i for i, token in added.items() if getattr(token, "special", False))

    @cached_property
    def max_token_chars(self) -> int:
        """No token stands for more characters of text than its piece has (byte-level,
        SentencePiece and WordPiece pieces are at least as long as their text), so a text
        of n characters has at least n / max_token_chars tokens."""
        return max(map(len, self.hf_tokenizer.get_vocab()), default=1) or 1

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback pieces (`<0x00>` ... `<0xFF>`); empty for
        vocabularies without them (e.g. byte-level BPE)."""
        vocab = self.hf_tokenizer.get_vocab()
        return frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))

    @cached_property
    def adds_bos(self) -> bool:
        """Whether `encode(text)` starts with BOS (the tokenizer's post-processor adds it)."""
        bos = self.bos_token_id
        if bos is None:
            return False
        with_special = self.encode("a", add_special_tokens=True)
        return with_special[:1] == [bos] and self.encode("a", add_special_tokens=False)[:1] != [bos]

    @cached_property
    def _added_tokens(self) -> re.Pattern | None:
        """Matches any added token's text (longest first); None without added tokens."""
        added = getattr(self.hf_tokenizer, "added_tokens_decoder", None) or {}
        texts = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """`spaces_between_special_tokens` only affects slow (SentencePiece) tokenizers;
        fast tokenizers ignore it."""
        if not spaces_between_special_tokens:
            return self.hf_tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False
            )
        return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        variables: dict | None = None,
    ) -> str:
        """The chat template's text for `messages` (validated first) and `variables`
        (`tools`, template kwargs). Unless `parse_special_tokens_in_content`, added-token
        text inside message content comes back between markers that `encode_chat` reads
        (and `plain_chat_text` drops)."""
        validate_messages(messages)
        if self.renderer is None:
            raise ValueError(
                f"tokenizer {Path(self.name_or_path).name!r} has no chat template; send a "
                "plain prompt instead, or use a chat model whose tokenizer_config.json has one"
            )
        if not self.parse_special_tokens_in_content:
            messages = [self._mark_content(m) for m in messages]
        return self.renderer.render(messages, add_generation_prompt, variables)

    def _mark_content(self, message: dict) -> dict:
        content = plain_chat_text(message["content"])
        if self._added_tokens is not None:
            content = self._added_tokens.sub(lambda m: f"{_OPEN}{m.group()}{_CLOSE}", content)
        return {**message, "content": content}

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of rendered chat text (the BOS rule of the class docstring): marked
        added-token text is encoded as text, the rest as the tokenizer would."""
        ids: list[int] = []
        for i, piece in enumerate(_MARKED.split(text)):
            if i % 2 == 0:
                ids += self.encode(plain_chat_text(piece), False)
            else:
                ids += self.hf_tokenizer.encode(
                    piece, add_special_tokens=False, split_special_tokens=True
                )
        bos_token = getattr(self.hf_tokenizer, "bos_token", None)
        if self.adds_bos and not (bos_token and text.startswith(bos_token)):
            ids = [self.bos_token_id, *ids]
        return ids

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        variables: dict | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (see the class docstring for the BOS rule)."""
        return self.encode_chat(self.render_chat(messages, add_generation_prompt, variables))


def plain_chat_text(text: str) -> str:
    """Rendered chat text (or any text) without `render_chat`'s markers."""
    return text.replace(_OPEN, "").replace(_CLOSE, "")
