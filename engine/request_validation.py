"""Checks every entry point runs on a request before any state changes."""

from __future__ import annotations

from engine.sampling_params import SamplingParams


def validate_request(
    token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    has_tokenizer: bool,
    beam_search: bool = True,
) -> None:
    """Raises ValueError naming the field and the allowed range. `beam_search`: the
    entry point runs beam search."""
    if params.use_beam_search and not beam_search:
        raise ValueError(
            "use_beam_search: beam search runs in the offline engine (LLM); this entry "
            "point does not serve it yet"
        )
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
    params.check_vocab(vocab_size)
    if not token_ids:
        raise ValueError("prompt is empty: it must have at least 1 token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids):,} tokens; this model's context (max_model_len) is "
            f"{max_model_len:,}, leaving no room to generate; shorten the prompt to at most "
            f"{max_model_len - 1:,} tokens"
        )
