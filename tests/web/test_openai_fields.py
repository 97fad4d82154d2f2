"""The field table (web/openai_fields.py) against the docs and a running server: every
refused field or value gets a 400 in OpenAI's error shape naming it, every value taken
with some values only is honoured (the reply is the one without it), and the doc is
the table."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from web.openai_fields import CHAT_RULES, COMPLETION_RULES, FieldRule, Support
from web.openai_fields_doc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai_fields.md"
ROUTES = {"completions": COMPLETION_RULES, "chat/completions": CHAT_RULES}
# What the issue asks the tables to cover, at least (OpenAI's fields and vLLM's extras).
REQUIRED = {
    "model", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "service_tier", "store", "metadata", "modalities", "audio",
    "prediction", "reasoning_effort", "web_search_options", "prompt", "messages",
    "max_completion_tokens", "best_of", "top_logprobs", "echo", "suffix",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "stop_token_ids",
    "use_beam_search", "length_penalty", "early_stopping", "prompt_logprobs",
    "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "add_special_tokens", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "structured_outputs",
}  # fmt: skip
BASE = {
    "completions": {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
    "chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    },
}


def _cases(support: set[Support]) -> list:
    return [
        pytest.param(route, rule, id=f"{route}:{rule.name}")
        for route, rules in ROUTES.items()
        for rule in rules.values()
        if rule.support in support
    ]


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http}/v1/{route}", json=body, timeout=60)


def test_doc_is_the_table() -> None:
    assert DOC.read_text() == render(), "regenerate: python -m web.openai_fields_doc > " + str(DOC)


@pytest.mark.parametrize("route", ROUTES)
def test_tables_cover_every_field_openai_and_vllm_define(route) -> None:
    assert REQUIRED <= set(ROUTES[route]), REQUIRED - set(ROUTES[route])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("route", "rule"), _cases({Support.REFUSED, Support.SOME_VALUES}))
def test_refused_field_is_a_400_naming_it(builtin_server, route: str, rule: FieldRule) -> None:
    reply = _post(builtin_server, route, {**BASE[route], rule.name: rule.refused_example})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["param"] == rule.name
    assert rule.name in error["message"] and "not supported" in error["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("route", "rule"), _cases({Support.SOME_VALUES}))
def test_accepted_value_is_honoured(builtin_server, route: str, rule: FieldRule) -> None:
    """A value taken is one whose meaning is what the server does anyway: greedy, the
    reply is the one without the field."""
    plain = _post(builtin_server, route, BASE[route])
    reply = _post(builtin_server, route, {**BASE[route], rule.name: rule.accepted_example})
    assert reply.status_code == plain.status_code == 200, reply.text
    assert _texts(reply.json()) == _texts(plain.json())


@pytest.mark.parametrize("route", ROUTES)
def test_null_is_not_set(builtin_server, route: str) -> None:
    nulls = {"metadata": None, "functions": None, "guided_json": None, "stream_options": None}
    reply = _post(builtin_server, route, {**BASE[route], **nulls})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_field_is_refused_by_name(builtin_server, route: str) -> None:
    reply = _post(builtin_server, route, {**BASE[route], "frobnicate": 1})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "frobnicate"


def _texts(reply: dict) -> list[str]:
    return [c.get("text") or c["message"]["content"] for c in reply["choices"]]
