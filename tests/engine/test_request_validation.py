"""validate_request's length rules: an explicit max_tokens past the context is refused
with vLLM's message (both numbers) when the caller asks for strictness (the OpenAI
routes); otherwise the request may run until the context is full (offline, as vLLM).
With a max_tokens_per_request cap, max_tokens times the sequences sampled is bounded."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.text.request_validation import RequestLimits, validate_request

pytestmark = pytest.mark.timeout(10)
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


CAPPED = RequestLimits(vocab_size=100, max_model_len=4096, max_tokens_per_request=8192)


def test_no_cap_by_default() -> None:
    wide = RequestLimits(vocab_size=100, max_model_len=4096)
    validate_request(PROMPT, SamplingParams(n=256, max_tokens=4000), wide)
    validate_request(PROMPT, SamplingParams(n=1, best_of=256, max_tokens=None), wide)


def test_n_times_max_tokens_past_the_cap_is_refused_naming_both() -> None:
    with pytest.raises(ValueError) as refused:
        validate_request(PROMPT, SamplingParams(n=16, max_tokens=2000), CAPPED)
    assert str(refused.value) == (
        "n × max_tokens = 16 × 2,000 = 32,000 output tokens, more than this engine's "
        "max_tokens_per_request (--max-tokens-per-request) of 8,192; lower n or max_tokens"
    )
    validate_request(PROMPT, SamplingParams(n=4, max_tokens=2048), CAPPED)  # exactly the cap


def test_best_of_counts_every_sequence_sampled() -> None:
    params = SamplingParams(n=1, best_of=8, max_tokens=2000)
    with pytest.raises(ValueError, match=r"^best_of × max_tokens = 8 × 2,000 = 16,000 ") as refused:
        validate_request(PROMPT, params, CAPPED)
    assert str(refused.value).endswith("lower best_of or max_tokens")


def test_beams_count_the_beam_width() -> None:
    beams = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=2100)
    with pytest.raises(ValueError, match=r"^best_of \(the beam width\) × max_tokens = 4 × 2,100"):
        validate_request(PROMPT, beams, CAPPED)
    narrow = beams.with_updates(best_of=None, n=4)
    with pytest.raises(ValueError, match=r"^n \(the beam width\) × max_tokens = 4 × 2,100"):
        validate_request(PROMPT, narrow, CAPPED)
    validate_request(PROMPT, beams.with_updates(max_tokens=2048), CAPPED)


def test_unset_max_tokens_counts_what_the_context_leaves() -> None:
    room = 4096 - len(PROMPT)  # 4,086 per sequence
    validate_request(PROMPT, SamplingParams(n=2, max_tokens=None), CAPPED)  # 8,172
    with pytest.raises(ValueError) as refused:
        validate_request(PROMPT, SamplingParams(n=3, max_tokens=None), CAPPED)
    message = str(refused.value)
    assert f"3 × {room:,} (unset: what the context leaves after the prompt) = {3 * room:,}" in (
        message
    )
    assert message.endswith("lower n or set max_tokens")


def test_max_tokens_past_the_context_counts_the_context() -> None:
    params = SamplingParams(n=3, max_tokens=100_000)
    with pytest.raises(ValueError, match=r"3 × 4,086 \(what the context leaves"):
        validate_request(PROMPT, params, CAPPED)  # offline: cut at the context, then counted
    with pytest.raises(ValueError, match=r"^max_tokens \(100000\) is too large"):
        validate_request(PROMPT, params, CAPPED, strict_max_tokens=True)  # served: refused
