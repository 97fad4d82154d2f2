import math

import pytest

from engine.sampling_params import (
    MAX_COUNT,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)

INVALID = [
    ("n", 0),
    ("n", -3),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("presence_penalty", "0.1"),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", True),
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", None),
    ("temperature", False),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.0),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.nan),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", True),
    # What the wire carries: a seed is 64-bit, counts are bounded (the 2**70 seed once
    # passed validation and then hung its request in the msgpack codec).
    ("seed", 2**70),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("top_k", 2**70),
    ("max_tokens", MAX_COUNT + 1),
    ("min_tokens", 2**100),
    ("stop_token_ids", [2**64]),
    ("logit_bias", {2**64: 1.0}),
    ("logit_bias", {"9" * 5000: 1.0}),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", "y" * (MAX_STOP_STRING_CHARS + 1)),
    ("stop", ["ok", "bad \ud800 surrogate"]),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("include_stop_str_in_output", 1),
    ("ignore_eos", "yes"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", True),
    ("max_tokens", 16.0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > default max_tokens 16
    ("min_tokens", 1.0),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", 0),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {1: -100.5}),
    ("logit_bias", {1: math.inf}),
    ("logit_bias", {1: "5"}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"-1": 1.0}),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {1.5: 1.0}),
    ("logit_bias", [1, 2]),
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_field_raises_naming_field(name, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{name: value})
    assert name in str(err.value)
    assert isinstance(err.value, ValueError)


def test_error_messages_are_specific():
    with pytest.raises(SamplingParamsError, match=r"temperature must be .*>= 0, got -1\.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingParamsError, match=r"top_p must be .*in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match=r"n must be an int in \[1, 256\], got 0"):
        SamplingParams(n=0)
    with pytest.raises(SamplingParamsError, match=r"max_tokens .* got True \(bool\)"):
        SamplingParams(max_tokens=True)


VALID = [
    {"temperature": 0.0},
    {"temperature": 0},
    {"temperature": 100.0},
    {"top_p": 1e-9},
    {"top_p": 1},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3},
    {"repetition_penalty": 50.0},
    {"seed": -(2**63)},
    {"seed": 2**64 - 1},
    {"stop": ["s"] * MAX_STOP_STRINGS},
    {"stop": "z" * MAX_STOP_STRING_CHARS},
    {"seed": 0},
    {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 1},
    {"max_tokens": 5, "min_tokens": 5},
    {"logprobs": 0, "prompt_logprobs": MAX_LOGPROBS},
    {"stop": []},
    {"stop_token_ids": []},
    {"stop_token_ids": (0, 5)},
    {"logit_bias": {}},
    {"logit_bias": {0: -100, 7: 100.0}},
    {"n": 8},
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_edge_values(kwargs):
    SamplingParams(**kwargs)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.repetition_penalty == 1.0 and p.presence_penalty == p.frequency_penalty == 0.0
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.seed is None


def test_normalization():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=[3, 4], temperature=0)
    assert p.top_k == 0
    assert p.stop == ("###",)
    assert p.stop_token_ids == (3, 4)
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_logit_bias_string_keys_and_copy():
    raw = {"12": 5, 3: -1.5}
    p = SamplingParams(logit_bias=raw)
    assert p.logit_bias == {12: 5.0, 3: -1.5}
    assert all(isinstance(k, int) for k in p.logit_bias)
    raw["99"] = 1.0
    assert 99 not in p.logit_bias


def test_frozen_and_hashable():
    p = SamplingParams(logit_bias={1: 1.0}, stop=["x"])
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
    hash(p)


def test_check_vocab():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}).check_vocab(10)
    with pytest.raises(SamplingParamsError, match="stop_token_ids.*10"):
        SamplingParams(stop_token_ids=[10]).check_vocab(10)
    with pytest.raises(SamplingParamsError, match="logit_bias.*10"):
        SamplingParams(logit_bias={"10": 1.0}).check_vocab(10)


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert not SamplingParams().is_greedy


def test_with_updates_validates():
    p = SamplingParams(temperature=0.7, stop="x")
    q = p.with_updates(max_tokens=32, top_k=-1)
    assert (q.max_tokens, q.top_k, q.temperature, q.stop) == (32, 0, 0.7, ("x",))
    assert p.max_tokens == 16
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        p.with_updates(max_tokens=0)
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        p.with_updates(min_tokens=20)
