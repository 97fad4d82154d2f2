"""validate_request's length rule: an explicit max_tokens past the context is refused
with vLLM's message (both numbers) when the caller asks for strictness (the OpenAI
routes); otherwise the request may run until the context is full (offline, as vLLM)."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.text.request_validation import RequestLimits, validate_request

LIMITS = RequestLimits(vocab_size=100, max_model_len=64)
PROMPT = list(range(10))


def test_past_the_context_is_refused_with_both_numbers() -> None:
    params = SamplingParams(max_tokens=60)
    with pytest.raises(ValueError) as refused:
        validate_request(PROMPT, params, LIMITS, "messages", strict_max_tokens=True)
    message = str(refused.value)
    assert message.startswith("max_tokens (60) is too large")
    assert "maximum context length is 64 tokens" in message
    assert "you requested 70 tokens (10 in the messages, 60 in the completion)" in message
    assert "at most 54" in message


def test_exactly_the_context_is_taken() -> None:
    validate_request(PROMPT, SamplingParams(max_tokens=54), LIMITS, strict_max_tokens=True)


def test_unset_or_lenient_runs_to_the_context() -> None:
    validate_request(PROMPT, SamplingParams(max_tokens=60), LIMITS)  # offline: cut
    validate_request(PROMPT, SamplingParams(max_tokens=None), LIMITS, strict_max_tokens=True)


def test_the_prompt_rule_comes_first() -> None:
    with pytest.raises(ValueError, match="prompt has 64 tokens"):
        validate_request(list(range(64)), SamplingParams(), LIMITS, strict_max_tokens=True)
