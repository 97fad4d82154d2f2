"""Every request field of /v1/completions and /v1/chat/completions that OpenAI or vLLM
defines, one rule each: supported, accepted with some values only, or refused, and why.

The routes check each body against these tables before anything else (`check_fields`);
docs/openai_fields.md is rendered from them (`python -m web.openai_fields_doc >
docs/openai_fields.md`), and a test keeps the two equal. A field is never accepted and
ignored: what is not honoured gets a 400 naming it. `null` means "not set" everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from web.errors import invalid


class Support(StrEnum):
    """What the server does with a field."""

    SUPPORTED = "supported"
    SOME_VALUES = "some values"  # the values named are honoured; others are refused
    REFUSED = "refused"


class Origin(StrEnum):
    OPENAI = "OpenAI"
    VLLM = "vLLM"
    ROUTER = "vllm-router"  # added by the router (vllm-router) to every request it forwards


@dataclass(frozen=True)
class FieldRule:
    """One field on one endpoint. `why`: one line, for the doc and the refusal message.
    SOME_VALUES: `accepts(value)` says whether a value is honoured; `values` names those
    values. `refused_example`: a value that gets the 400; `accepted_example` (SOME_VALUES):
    one that is honoured (the tests send both)."""

    name: str
    origin: Origin
    support: Support
    why: str
    values: str = ""
    accepts: Callable[[Any], bool] | None = None
    refused_example: Any = None
    accepted_example: Any = None

    def check(self, value: Any) -> None:
        """Raises the 400 for a value this rule refuses (None: not set, never refused)."""
        if value is None or self.support is Support.SUPPORTED:
            return
        if self.support is Support.REFUSED:
            raise invalid(f"{self.name} is not supported: {self.why}", self.name)
        if not self.accepts(value):
            shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
            raise invalid(
                f"{self.name}={shown} is not supported (accepted: {self.values}): {self.why}",
                self.name,
            )


def _supported(name: str, why: str, origin: Origin = Origin.OPENAI) -> FieldRule:
    return FieldRule(name, origin, Support.SUPPORTED, why)


def _refused(name: str, why: str, example: Any, origin: Origin = Origin.OPENAI) -> FieldRule:
    return FieldRule(name, origin, Support.REFUSED, why, refused_example=example)


def _some(
    name: str,
    values: str,
    accepts: Callable[[Any], bool],
    why: str,
    examples: tuple[Any, Any],
    origin: Origin = Origin.OPENAI,
) -> FieldRule:
    """`examples`: (an accepted value, a refused value)."""
    good, bad = examples
    return FieldRule(name, origin, Support.SOME_VALUES, why, values, accepts, bad, good)


_V = Origin.VLLM
_OLD_FUNCTIONS = "OpenAI's deprecated spelling: send tools and tool_choice"
_TEXT_ONLY = "this server serves a text-only model"
_DOC = "[structured_outputs.md](structured_outputs.md)"
_TOOLS_DOC = "[tool_calling.md](tool_calling.md)"
_A_TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}

COMMON = [
    _supported("model", "must be the served model's name (`/v1/models`); another gets 404"),
    _supported("n", "choices per prompt, 1 to 16: one sequence group sharing the prompt's blocks"),
    _supported("stream", "server-sent events, ending with `data: [DONE]`"),
    _supported(
        "stream_options",
        "`include_usage` only, and only with `stream: true` (vLLM's "
        "`continuous_usage_stats` is refused)",
    ),
    _supported(
        "max_tokens",
        "at most the context left after the prompt: more is a 400 giving both numbers (unset: "
        "the server's `--default-max-tokens`, cut to the context)",
    ),
    _supported("temperature", ">= 0; 0 is greedy"),
    _supported("top_p", "in (0, 1]"),
    _supported(
        "stop",
        "up to 32 strings of up to 128 characters; text that may start one is held back, "
        "never sent and then taken back",
    ),
    _supported("seed", "a 64-bit int; choice i samples with seed + i"),
    _supported("presence_penalty", "in [-2, 2]"),
    _supported("frequency_penalty", "in [-2, 2]"),
    _supported("logit_bias", "token id -> bias in [-100, 100]"),
    _supported(
        "user",
        "up to 256 characters that only identify the caller: logged with the request id "
        "(INFO), nothing else",
    ),
    _supported(
        "response_format",
        '`{"type": "text"}` (no constraint), `"json_object"` or `"json_schema"` (its `schema` '
        f"is enforced, whatever `strict` says; `name` and `description` only label it): {_DOC}",
    ),
    _some(
        "service_tier",
        '`"auto"`, `"default"`',
        lambda v: v in ("auto", "default"),
        "there is one tier: every request is served alike",
        ("auto", "flex"),
    ),
    _some(
        "store",
        "`false`",
        lambda v: v is False,
        "this server stores no completions",
        (False, True),
    ),
    _refused("metadata", "only with `store: true`, and this server stores nothing", {"k": "v"}),
    _refused("functions", _OLD_FUNCTIONS, [{"name": "f", "parameters": {}}]),
    _refused("function_call", _OLD_FUNCTIONS, "auto"),
    _refused("audio", _TEXT_ONLY, {"voice": "alloy", "format": "wav"}),
    _refused("prediction", "no predicted outputs", {"type": "content", "content": "x"}),
    _refused("reasoning_effort", "the model is not a reasoning model", "low"),
    _refused("web_search_options", "no web search", {}),
    _supported("top_k", "0 or -1: off", _V),
    _supported("min_p", "in [0, 1]", _V),
    _supported("repetition_penalty", "> 0", _V),
    _supported("ignore_eos", "generate past the end-of-sequence token", _V),
    _supported("min_tokens", "no EOS, stop token or stop string before this many tokens", _V),
    _supported("skip_special_tokens", "special tokens left out of the text (default true)", _V),
    _supported("spaces_between_special_tokens", "only slow (SentencePiece) tokenizers use it", _V),
    _supported("include_stop_str_in_output", "keep the stop string that ended a choice", _V),
    _supported("stop_token_ids", "up to 1,024 token ids that end a choice", _V),
    _supported("use_beam_search", "beam width `best_of`, else `n`; returns the n best", _V),
    _supported(
        "length_penalty",
        "beam score = sum of logprobs / length ** length_penalty; other than 1 only with "
        "use_beam_search",
        _V,
    ),
    _supported(
        "early_stopping",
        'true, false or "never", as in Hugging Face; other than false only with use_beam_search',
        _V,
    ),
    _supported(
        "structured_outputs",
        "one of `json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag`, with "
        f"`disable_any_whitespace`, `disable_additional_properties`: {_DOC}",
        _V,
    ),
    _supported("guided_json", "as `structured_outputs.json` (a schema object or its text)", _V),
    _supported("guided_regex", "as `structured_outputs.regex`", _V),
    _supported("guided_choice", "as `structured_outputs.choice`", _V),
    _supported("guided_grammar", "as `structured_outputs.grammar` (EBNF)", _V),
    _some(
        "guided_decoding_backend",
        '`"xgrammar"`, `"auto"`',
        lambda v: v in ("xgrammar", "auto"),
        "structured outputs are compiled by xgrammar",
        ("xgrammar", "outlines"),
        _V,
    ),
    _refused(
        "guided_whitespace_pattern",
        "xgrammar takes no whitespace pattern: use structured_outputs.disable_any_whitespace",
        " ",
        _V,
    ),
    _refused(
        "structural_tag", "send it as structured_outputs.structural_tag", '{"structures": []}', _V
    ),
    _refused("truncate_prompt_tokens", "prompts are never truncated: shorten it", 8, _V),
    _refused("allowed_token_ids", "not implemented: use logit_bias", [1, 2], _V),
    _refused("bad_words", "not implemented: use logit_bias", ["x"], _V),
    _refused("priority", "the scheduler is first come, first served", 1, _V),
    _refused("request_id", "the server names each request itself", "mine", _V),
    _refused("return_tokens_as_token_ids", "not implemented", True, _V),
    _refused("logits_processors", "no custom logits processors", ["p"], _V),
    _refused("cache_salt", "the prefix cache is shared by every request", "salt", _V),
    _supported(
        "kv_transfer_params",
        "prefill/decode disaggregation, vLLM's keys (`do_remote_decode` to a prefill "
        "instance, `do_remote_prefill` and where the KV waits to a decode instance); needs "
        "`--kv-transfer-config` ([kv_transfer.md](kv_transfer.md))",
        _V,
    ),
    _some(
        "no_stop_trim",
        "`false`",
        lambda v: v is False,
        "stop strings are trimmed from the text (`include_stop_str_in_output` keeps them)",
        (False, True),
        Origin.ROUTER,
    ),
    _some(
        "return_hidden_states",
        "`false`",
        lambda v: v is False,
        "hidden states are not returned",
        (False, True),
        Origin.ROUTER,
    ),
]

COMPLETIONS_ONLY = [
    _supported("prompt", "a string, a list of strings, token ids, or a list of token-id lists"),
    _supported(
        "logprobs",
        "a count, 0 to 20: tokens (the text each adds, so they join into the choice's "
        "text), token_logprobs, top_logprobs, text_offset (the running length of the "
        "tokens before, as vLLM counts it)",
    ),
    _supported(
        "echo",
        "the prompt's text before each choice's text (token ids decoded); with logprobs, "
        "the prompt's tokens first, the first with a null logprob",
    ),
    _supported("best_of", "n to 16: the n of highest cumulative logprob; not with stream"),
    _some(
        "suffix",
        '`""`',
        lambda v: v == "",
        "no fill-in-the-middle: the model has no insertion format",
        ("", "}"),
    ),
    _some(
        "add_special_tokens",
        "`true`",
        lambda v: v is True,
        "prompts are tokenized with the tokenizer's special tokens (BOS), as given",
        (True, False),
        _V,
    ),
    _refused("prompt_logprobs", "use `echo: true` with `logprobs`", 1, _V),
    _refused("prompt_embeds", _TEXT_ONLY, "AAAA", _V),
    _refused("messages", "a chat completions field: use /v1/chat/completions", []),
    _refused("max_completion_tokens", "a chat completions field: use max_tokens", 8),
    _refused("top_logprobs", "a chat completions field: logprobs is the count here", 2),
    _refused("tools", "a chat completions field", [_A_TOOL]),
    _refused("tool_choice", "a chat completions field", "auto"),
    _refused("parallel_tool_calls", "a chat completions field", True),
    _refused("modalities", "a chat completions field", ["text"]),
    _refused("add_generation_prompt", "a chat completions field", True, _V),
    _refused("continue_final_message", "a chat completions field", False, _V),
    _refused("chat_template", "a chat completions field", "{{ messages }}", _V),
    _refused("chat_template_kwargs", "a chat completions field", {"a": 1}, _V),
]

CHAT_ONLY = [
    _supported(
        "messages",
        "system, user, assistant and tool turns with string content or text parts, an "
        "assistant's `tool_calls` and a tool's `tool_call_id` (and `name`); image, audio "
        "and file parts are refused (text-only model)",
    ),
    _supported(
        "max_completion_tokens", "as max_tokens (and preferred to it); with both, they must agree"
    ),
    _supported(
        "logprobs",
        "true: each token's logprob, its text and bytes (`top_logprobs: []` unless "
        "top_logprobs asks for alternatives)",
    ),
    _supported("top_logprobs", "0 to 20 alternatives per token; needs logprobs: true"),
    _supported(
        "tools",
        "function tools (up to 128, unique names); their `parameters` schemas constrain "
        f"`required` and named choices: {_TOOLS_DOC}",
    ),
    _supported(
        "tool_choice",
        '`"none"`, `"required"` or a named function (a grammar writes the calls); `"auto"` '
        "(the default with tools) with `--enable-auto-tool-choice --tool-call-parser`",
    ),
    _supported(
        "parallel_tool_calls",
        '`false` holds `"required"` to one call; refused under `"auto"` (free text cannot '
        "be held to it)",
    ),
    _some(
        "modalities",
        '`["text"]`',
        lambda v: v == ["text"],
        _TEXT_ONLY,
        (["text"], ["text", "audio"]),
    ),
    _some(
        "echo",
        "`false`",
        lambda v: v is False,
        "echoing the last message needs continue_final_message, which is not implemented",
        (False, True),
        _V,
    ),
    _some(
        "add_generation_prompt",
        "`true`",
        lambda v: v is True,
        "the chat template always opens the assistant's turn",
        (True, False),
        _V,
    ),
    _some(
        "continue_final_message",
        "`false`",
        lambda v: v is False,
        "a reply always starts a new assistant turn",
        (False, True),
        _V,
    ),
    _refused("chat_template", "the model's own chat template is used", "{{ messages }}", _V),
    _supported(
        "chat_template_kwargs",
        "extra chat template variables (e.g. `enable_thinking`); not `messages`, `tools`, "
        "`documents`, `add_generation_prompt`",
        _V,
    ),
    _supported(
        "include_reasoning",
        "false drops `reasoning_content` (with `--reasoning-parser`); default true",
        _V,
    ),
    _refused(
        "add_special_tokens",
        "a chat prompt is the template's text, with BOS when the template leaves it out",
        True,
        _V,
    ),
    _refused("documents", "the model's own chat template is used", [{"text": "x"}], _V),
    _refused("prompt_logprobs", "not implemented for chat", 1, _V),
    _some(
        "separate_reasoning",
        "`true`",
        lambda v: v is True,
        "`<think>` reasoning goes to `reasoning_content` when the server runs "
        "`--reasoning-parser` (without one there is none to separate)",
        (True, False),
        Origin.ROUTER,
    ),
    _some(
        "stream_reasoning",
        "`true`",
        lambda v: v is True,
        "reasoning streams as it is generated",
        (True, False),
        Origin.ROUTER,
    ),
    _refused("prompt", "a completions field: use /v1/completions", "hi"),
    _refused("best_of", "a completions field (use_beam_search takes its width from n)", 2),
    _refused("suffix", "a completions field", "x"),
]


def _table(*groups: list[FieldRule]) -> dict[str, FieldRule]:
    rules = [rule for group in groups for rule in group]
    table = {rule.name: rule for rule in rules}
    if len(table) != len(rules):
        raise AssertionError("a field has two rules")
    return table


COMPLETION_RULES = _table(COMPLETIONS_ONLY, COMMON)
CHAT_RULES = _table(CHAT_ONLY, COMMON)


def accepted(rules: dict[str, FieldRule]) -> frozenset[str]:
    """The fields a route takes (some with some values only)."""
    return frozenset(name for name, rule in rules.items() if rule.support is not Support.REFUSED)


def check_fields(body: dict[str, Any], rules: dict[str, FieldRule]) -> None:
    """400 for an unknown field (naming the first), then for a refused field or value."""
    unknown = sorted(set(body) - set(rules), key=repr)  # keys of any type
    if unknown:
        first = unknown[0] if isinstance(unknown[0], str) else repr(unknown[0])
        raise invalid(f"unknown field(s) {unknown} in the request", first)
    for name, value in body.items():
        rules[name].check(value)
