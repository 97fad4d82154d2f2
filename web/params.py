"""Request bodies -> SamplingParams: the field names of OpenAI's API and vLLM's extras,
checked before anything reaches the engine. Every error names its field."""

from __future__ import annotations

import re
from typing import Any

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.text.text_checks import check_text
from web.errors import invalid
from web.structured_fields import structured_outputs

# Body fields passed through to SamplingParams under the same name.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
)
# vLLM's beam search extras (OpenAI routes): the width is best_of, else n.
BEAM_FIELDS = ("use_beam_search", "length_penalty", "early_stopping")
MAX_N = 16


def sampling_params(body: dict[str, Any], *, chat: bool, default_max_tokens: int) -> SamplingParams:
    """The SamplingParams of one OpenAI-style body (`chat`: the chat completions
    flavour of logprobs); n is left at 1 (the caller fans out `n`). Its structured
    outputs come from whichever spelling the body uses (web/structured_fields.py). A
    value that would change nothing (beam search extras without use_beam_search) is
    refused naming it."""
    fields = (*SAMPLING_FIELDS, *BEAM_FIELDS)
    kwargs: dict[str, Any] = {k: body[k] for k in fields if body.get(k) is not None}
    kwargs["max_tokens"] = _max_tokens(body, default_max_tokens)
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    kwargs.update(_logprobs(body, chat))
    kwargs["structured_outputs"] = structured_outputs(body)
    if body.get("kv_transfer_params") is not None:
        kwargs["kv_transfer_params"] = body["kv_transfer_params"]
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise invalid(str(exc), field_of(str(exc))) from None
    _check_beam_extras(params)
    return params


def _max_tokens(body: dict[str, Any], default: int) -> Any:
    """max_completion_tokens (chat's name), else max_tokens, else `default`; both set
    to different values is refused (neither would be honoured silently)."""
    given = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise invalid(
            f"max_tokens ({_short(given[1])}) and max_completion_tokens ({_short(given[0])}) "
            "differ; send one (max_completion_tokens is preferred)",
            "max_tokens",
        )
    return given[0] if given else default


def _check_beam_extras(params: SamplingParams) -> None:
    """length_penalty and early_stopping shape a beam search only: without
    use_beam_search, a value other than the default would be ignored."""
    if params.use_beam_search:
        return
    if params.length_penalty != 1.0:
        raise invalid(
            f"length_penalty={params.length_penalty:g} needs use_beam_search: true (it "
            "scores beams; sampling ignores it)",
            "length_penalty",
        )
    if params.early_stopping is not False:
        raise invalid(
            f"early_stopping={params.early_stopping!r} needs use_beam_search: true (it "
            "ends a beam search; sampling ignores it)",
            "early_stopping",
        )


def best_of(body: dict[str, Any], n: int, stream: bool) -> int | None:
    """Completions' best_of: None, or an int in [n, MAX_N]; above n it cannot stream
    (the n best are known only once every sequence has ended) unless it is a beam
    search's width (whose outputs all arrive whole at its end anyway)."""
    value = body.get("best_of")
    if value is None or value == n:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not n <= value <= MAX_N:
        raise invalid(f"best_of must be an int in [n={n}, {MAX_N}], got {value!r}", "best_of")
    if stream and body.get("use_beam_search") is not True:
        raise invalid("best_of > n cannot be streamed; set stream to false", "best_of")
    return value


def num_choices(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise invalid(f"n must be an int in [1, {MAX_N}], got {n!r}", "n")
    return n


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise invalid(f"logit_bias must be a map of token id -> bias, got {value!r}", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        out[token] = bias
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The engine's `logprobs`: a count of top alternatives per token, 0 for the chosen
    token's own logprob only (chat's `logprobs: true` without top_logprobs)."""
    if chat:  # chat: logprobs is a bool, top_logprobs the count
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise invalid(f"logprobs must be a bool, got {_short(wanted)}", "logprobs")
        if top is not None and not wanted:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        if top is not None and not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
            rule = f"an int in [0, {MAX_LOGPROBS}]"
            raise invalid(f"top_logprobs must be {rule}, got {_short(top)}", "top_logprobs")
        return {"logprobs": top or 0} if wanted else {}
    count = body.get("logprobs")  # completions: logprobs is the count
    return {} if count is None else {"logprobs": count}


_FIELD_HEAD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRUCTURED_PATH = re.compile(r"\bstructured_outputs(?:\.[A-Za-z_][A-Za-z0-9_]*)?\b")
KNOWN_FIELDS = frozenset(
    {*SAMPLING_FIELDS, *BEAM_FIELDS, "n", "best_of", "max_tokens", "logprobs", "top_logprobs"}
    | {"logit_bias", "prompt", "messages", "prompt_token_ids", "request_id", "use_beam_search"}
    | {"prompt_logprobs", "max_completion_tokens", "structured_outputs"}
)


def field_of(message: str) -> str | None:
    """The field an engine error names: validation errors start with it
    ("seed must be ...", "messages[0].content holds ..."); a structured-outputs error
    is named down to its field ("structured_outputs.regex"), wherever the message
    mentions it (the grammar compiler's errors may not start with it)."""
    head = _FIELD_HEAD.match(message)
    if head and head.group() in KNOWN_FIELDS and head.group() != "structured_outputs":
        return head.group()
    path = _STRUCTURED_PATH.search(message)
    return path.group() if path else None


# Content part types of OpenAI's and vLLM's chat messages that carry media, not text.
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "image_embeds", "input_audio", "audio_url"}
    | {"audio", "file", "input_file", "video_url", "video"}
)


# The message fields beside role and content that reach the chat template, by role.
TOOL_FIELDS = {"assistant": frozenset({"tool_calls"}), "tool": frozenset({"tool_call_id", "name"})}


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> [{role, content, ...}] (text content parts joined; an
    assistant turn's `tool_calls`, a tool turn's `tool_call_id` and `name` kept). Any
    other message field, and a content part that is not text (an image, audio, a file),
    is refused by its path: the model reads text only, and nothing sent is dropped."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list of {role, content}", "messages")
    return [_chat_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _chat_message(m: Any, where: str) -> dict[str, Any]:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        raise invalid(f"{where} must be an object with a role", "messages")
    allowed = TOOL_FIELDS.get(m["role"], frozenset())
    extra = sorted(set(m) - {"role", "content"} - allowed, key=repr)
    if extra:
        path = f"{where}.{extra[0]}"
        raise invalid(
            f"{path} is not supported on a {m['role']!r} turn: a message reaches the chat "
            "template as its role and content (and an assistant's tool_calls, a tool's "
            "tool_call_id and name); participant names are not supported",
            path,
        )
    out: dict[str, Any] = {"role": m["role"]}
    calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
    content = m.get("content")
    if content is None and calls:
        content = ""  # a turn that only called tools
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = enumerate(content)
        content = "".join(_text_part(part, f"{where}.content[{j}]") for j, part in parts)
    if not isinstance(content, str):
        raise invalid(
            f"{where}.content must be a string or a list of text parts", f"{where}.content"
        )
    out["content"] = content
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise invalid(f"{where}.{key} must be a string", f"{where}.{key}")
            out[key] = m[key]
    if m["role"] == "tool" and "tool_call_id" not in out:
        raise invalid(
            f"{where}.tool_call_id must name the call this answers", f"{where}.tool_call_id"
        )
    return out


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's calls, OpenAI's shape: [{id, type: "function", function: {name,
    arguments (JSON text)}}]."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"{where} must be a list of tool calls", where)
    out = []
    for i, call in enumerate(value):
        path = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(call, dict) and call.get("type", "function") == "function"
        ok = ok and isinstance(call.get("id"), str) and isinstance(function, dict)
        ok = ok and isinstance(function.get("name"), str)
        ok = ok and isinstance(function.get("arguments"), str)
        if not ok:
            raise invalid(
                f'{path} must be {{"id": str, "type": "function", "function": {{"name": str, '
                '"arguments": JSON text}}}',
                path,
            )
        named = {"name": function["name"], "arguments": function["arguments"]}
        out.append({"id": call["id"], "type": "function", "function": named})
    return out


TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
MAX_TEMPLATE_KWARGS = 64


def template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs`: extra variables for the chat template (Qwen3's
    `enable_thinking`, ...). Names the template sets itself (`messages`, `tools`, ...)
    are refused: they have fields of their own."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise invalid(
            f"chat_template_kwargs must be an object of at most {MAX_TEMPLATE_KWARGS} "
            "template variables",
            "chat_template_kwargs",
        )
    for key in value:
        if not (isinstance(key, str) and key.isidentifier()):
            raise invalid(
                f"chat_template_kwargs keys must be identifiers, got {_short(key)}",
                "chat_template_kwargs",
            )
        if key in TEMPLATE_RESERVED:
            raise invalid(
                f"chat_template_kwargs.{key} is set by the request itself, not as a kwarg",
                f"chat_template_kwargs.{key}",
            )
    return value


def _text_part(part: Any, where: str) -> str:
    """The text of one content part `{"type": "text", "text": ...}`; 400 for any other."""
    if not isinstance(part, dict):
        raise invalid(f"{where} must be a content part object", where)
    kind = part.get("type")
    if kind in MEDIA_PART_TYPES:
        raise invalid(
            f"{where}.type {kind!r} is not supported: this server serves a text-only model",
            f"{where}.type",
        )
    if kind != "text":
        raise invalid(f"{where}.type must be 'text', got {_short(kind)}", f"{where}.type")
    extra = sorted(set(part) - {"type", "text"}, key=repr)
    if extra:
        raise invalid(f"{where}.{extra[0]} is not supported in a text part", f"{where}.{extra[0]}")
    if not isinstance(part.get("text"), str):
        raise invalid(f"{where}.text must be a string", f"{where}.text")
    return part["text"]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether the stream ends with a usage chunk. stream_options needs stream: true
    (as vLLM says) and takes include_usage only."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    if not stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    for key in options:
        if key != "include_usage":
            raise invalid(
                f"stream_options.{_short(key)} is not supported; stream_options takes "
                "include_usage only",
                "stream_options",
            )
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        shown = _short(include)
        raise invalid(f"stream_options.include_usage must be a bool, got {shown}", "stream_options")
    return bool(include)


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A bool field (null or absent: `default`)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a bool, got {_short(value)}", name)
    return value


def user_of(body: dict[str, Any]) -> str | None:
    """OpenAI's `user`: a string of at most 256 characters that identifies the caller."""
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= 256):
        shown = _short(user)
        raise invalid(f"user must be a string of at most 256 characters, got {shown}", "user")
    return None if user is None else valid_text("user", user)


def valid_text(name: str, text: str) -> str:
    """`text` if it is valid Unicode (no lone surrogate), else invalid_request naming it."""
    try:
        check_text(name, text)
    except ValueError as exc:
        raise invalid(str(exc), name) from None
    return text


def only_keys(message: dict[str, Any], allowed: set[str], what: str) -> None:
    """Refuses a message with fields outside `allowed`, naming the first."""
    unknown = sorted(set(message) - allowed, key=repr)  # keys of any type (msgpack)
    if unknown:
        first = unknown[0] if isinstance(unknown[0], str) else repr(unknown[0])
        raise invalid(f"unknown field(s) {unknown} in {what}", first)
