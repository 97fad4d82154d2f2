"""`speculative_config` parsing (engine/speculative_config.py): vLLM's shape and
defaults, and every key or method we do not implement refused by name."""

from __future__ import annotations

import pytest

from engine.speculative_config import SpeculativeConfig, SpeculativeMethod

pytestmark = pytest.mark.timeout(30)


def test_ngram_with_vllm_defaults_for_the_lookup_bounds() -> None:
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    upper = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert (upper.prompt_lookup_min, upper.prompt_lookup_max) == (3, 3)
    lower = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    )
    assert (lower.prompt_lookup_min, lower.prompt_lookup_max) == (2, 2)
    given = SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    )
    assert given == SpeculativeConfig(SpeculativeMethod.NGRAM, 2, 1, 4)


def test_draft_model_takes_a_model_and_is_implied_by_one() -> None:
    config = SpeculativeConfig.parse({"model": "small", "num_speculative_tokens": 3})
    assert config == SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model="small")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"method": "eagle", "num_speculative_tokens": 3},
            r"method must be one of \['ngram', 'draft_model'\]; got 'eagle'",
        ),
        ({"num_speculative_tokens": 3}, "method must be one of"),
        ({"method": "ngram"}, r"num_speculative_tokens must be an int in \[1, 16\]; got None"),
        (
            {"method": "ngram", "num_speculative_tokens": 17},
            r"num_speculative_tokens must be an int in \[1, 16\]; got 17",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": True},
            "num_speculative_tokens must be an int",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            r"prompt_lookup_max must be an int in \[1, 1024\]",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "'draft_tensor_parallel_size' not supported for method 'ngram'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        (
            {
                "method": "draft_model",
                "model": "m",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },
            "'prompt_lookup_max' not supported for method 'draft_model'",
        ),
        ("ngram", "must be a JSON object"),
    ],
)
def test_refusals_name_the_field(config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)
