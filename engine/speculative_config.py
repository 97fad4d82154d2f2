"""`speculative_config`: how draft tokens are proposed (vLLM's shape and spelling).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4}

`SpeculativeConfig.parse` takes the dict a user gives (`LLM(speculative_config=...)`,
`--speculative-config` JSON) and refuses, by name, any key or method this engine does
not implement rather than ignoring it. As in vLLM, an ngram config with neither lookup
bound uses 5 for both, and one bound alone sets the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_SPECULATIVE_TOKENS = 16  # verifying more per step costs more than it could save


class SpeculativeMethod(StrEnum):
    NGRAM = "ngram"  # prompt lookup: copies from the sequence itself, no model
    DRAFT_MODEL = "draft_model"  # a smaller model with its own paged KV cache


_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size"}
_KEYS = {
    SpeculativeMethod.NGRAM: _COMMON | {"prompt_lookup_min", "prompt_lookup_max"},
    SpeculativeMethod.DRAFT_MODEL: _COMMON | {"model"},
}
_DEFAULT_LOOKUP = 5
_LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative_config: k = `num_speculative_tokens` drafts per sequence
    and step; `prompt_lookup_min/max` for ngram (the n-gram lengths tried); `model` for
    draft_model (a checkpoint sharing the target's vocabulary);
    `disable_by_batch_size`: no sequence speculates in a step while more than this many
    run (None: any batch)."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, config: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {config!r}")
        method = _method(config.get("method", "draft_model" if "model" in config else None))
        unknown = sorted(set(config) - _KEYS[method])
        if unknown:
            raise ValueError(
                f"speculative_config: {', '.join(map(repr, unknown))} not supported for "
                f"method {method.value!r}; allowed keys: {sorted(_KEYS[method])}"
            )
        k = _positive_int(config, "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
        batch = None
        if config.get("disable_by_batch_size") is not None:
            batch = _positive_int(config, "disable_by_batch_size", 1 << 20)
        if method is SpeculativeMethod.DRAFT_MODEL:
            model = config.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "speculative_config: method 'draft_model' needs 'model', a path or hub id"
                )
            return cls(method, k, model=model, disable_by_batch_size=batch)
        given = {key: _positive_int(config, key, 1024) for key in _LOOKUP_KEYS if key in config}
        lo = given.get("prompt_lookup_min", given.get("prompt_lookup_max", _DEFAULT_LOOKUP))
        hi = given.get("prompt_lookup_max", lo)
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
            )
        return cls(
            method, k, prompt_lookup_min=lo, prompt_lookup_max=hi, disable_by_batch_size=batch
        )


def _method(value: Any) -> SpeculativeMethod:
    try:
        return SpeculativeMethod(value)
    except ValueError:
        allowed = [m.value for m in SpeculativeMethod]
        raise ValueError(
            f"speculative_config: method must be one of {allowed}; got {value!r} (EAGLE, MTP "
            "and Medusa heads need their trained weights and are not implemented)"
        ) from None


def _positive_int(config: dict[str, Any], key: str, limit: int) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"speculative_config: {key} must be an int in [1, {limit}]; got {value!r}")
    return value
