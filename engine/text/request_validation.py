"""Checks every entry point runs on a request before any state changes."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.beam_group import beam_params, beam_search_for
from engine.kv.block_count import cdiv
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv_transfer.config import KVRole
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's vocabulary, context and end tokens
    (a beam search ranks one continuation per end token more), whether text can be
    decoded (stop strings), the KV cache's size in blocks and the sequences a step may
    run (0: not checked), the most output tokens one request may ask for over all
    the sequences it samples (None: no cap), the KV cache groups (None: one
    full-attention group; sliding windows need fewer blocks per sequence), and the
    most tokens a step computes (`max_num_batched_tokens`; None: a whole sequence)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    has_tokenizer: bool = True
    num_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 0
    max_tokens_per_request: int | None = None
    kv_layout: KVCacheLayout | None = None
    max_chunk: int | None = None
    kv_role: KVRole | None = None  # prefill/decode disaggregation (None: no KV transfer)


def validate_request(
    token_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    field: str = "prompt",
    *,
    strict_max_tokens: bool = False,
) -> None:
    """Raises ValueError naming the field and the allowed range (`field`: what the
    prompt's tokens came from: "prompt", text or token ids, or "messages").
    `strict_max_tokens`: the client chose max_tokens, so a prompt plus max_tokens past
    the context is refused (vLLM's OpenAI server); otherwise the request generates until
    the context is full (vLLM's offline LLM)."""
    vocab_size, max_model_len = limits.vocab_size, limits.max_model_len
    if params.stop and not limits.has_tokenizer:
        raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
    params.check_vocab(vocab_size)
    if not token_ids:
        raise ValueError(f"{field} is empty: it must give at least 1 token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token ids must be in [0, {vocab_size}); got {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"{field} has {len(token_ids):,} tokens; this model's context (max_model_len) is "
            f"{max_model_len:,}, leaving no room to generate; shorten it to at most "
            f"{max_model_len - 1:,} tokens"
        )
    if strict_max_tokens:
        _check_max_tokens(len(token_ids), params, max_model_len, field)
    _check_total_output(len(token_ids), params, limits)
    if params.kv_transfer_params is not None:
        _check_kv_transfer(params, limits.kv_role)
    if params.use_beam_search:
        _check_beam_search(token_ids, params, limits)


def _check_kv_transfer(params: SamplingParams, role: KVRole | None) -> None:
    """kv_transfer_params this instance can honour (its role, one sequence)."""
    kv = params.kv_transfer_params
    wanted, direction = (
        ("produces", "do_remote_decode")
        if kv.do_remote_decode
        else (
            "consumes",
            "do_remote_prefill",
        )
    )
    if role is None:
        raise ValueError(
            f"kv_transfer_params: {direction} needs a server started with "
            "--kv-transfer-config; this one transfers no KV"
        )
    if not getattr(role, wanted):
        raise ValueError(f"kv_transfer_params: {direction} is not for a {role.value} instance")
    if params.num_sequences > 1 or params.use_beam_search:
        raise ValueError("kv_transfer_params: one sequence per request (n=1, no best_of or beams)")
    if kv.do_remote_prefill and params.prompt_logprobs is not None:
        raise ValueError(
            "kv_transfer_params: prompt_logprobs cannot be given for a prompt computed elsewhere"
        )


def _check_max_tokens(
    num_prompt_tokens: int, params: SamplingParams, max_model_len: int, field: str
) -> None:
    """vLLM's answer, word for word after the field's name, to a prompt plus max_tokens
    past the context."""
    wanted = params.max_tokens
    if wanted is None or num_prompt_tokens + wanted <= max_model_len:
        return
    raise ValueError(
        f"max_tokens ({wanted}) is too large: This model's maximum context length is "
        f"{max_model_len} tokens. However, you requested {num_prompt_tokens + wanted} tokens "
        f"({num_prompt_tokens} in the {field}, {wanted} in the completion). Please reduce "
        f"the length of the {field} or completion (max_tokens can be at most "
        f"{max_model_len - num_prompt_tokens} here)."
    )


def _check_total_output(
    num_prompt_tokens: int, params: SamplingParams, limits: RequestLimits
) -> None:
    """One request's work is bounded: max_tokens (unset or past the context: what the
    context leaves) for each sequence it samples (best_of, else n; beams alike) is at
    most `limits.max_tokens_per_request`."""
    cap = limits.max_tokens_per_request
    room = limits.max_model_len - num_prompt_tokens
    per_sequence = room if params.max_tokens is None else min(params.max_tokens, room)
    total = params.num_sequences * per_sequence
    if cap is None or total <= cap:
        return
    count = "best_of" if params.best_of is not None and params.best_of > params.n else "n"
    width = " (the beam width)" if params.use_beam_search else ""
    shown, advice = f"{per_sequence:,}", f"lower {count} or max_tokens"
    if params.max_tokens is None:
        shown += " (unset: what the context leaves after the prompt)"
        advice = f"lower {count} or set max_tokens"
    elif params.max_tokens > room:
        shown += " (what the context leaves after the prompt)"
    raise ValueError(
        f"{count}{width} × max_tokens = {params.num_sequences:,} × {shown} = {total:,} "
        f"output tokens, more than this engine's max_tokens_per_request "
        f"(--max-tokens-per-request) of {cap:,}; {advice}"
    )


def _check_beam_search(token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """The search ranks at most MAX_LOGPROBS continuations per beam, and its beams fit the
    KV cache together: a beam group is preempted and readmitted as one unit, each beam
    on blocks of its own, so one that can never fit would wait forever."""
    search = beam_search_for(params, len(token_ids), limits.max_model_len, limits.eos_token_ids)
    beam_params(params, search.num_candidates)  # raises if the search ranks too many
    width = params.beam_width
    if limits.max_num_seqs and width > limits.max_num_seqs:
        raise ValueError(
            f"best_of (the beam width; n when unset) must be <= max_num_seqs "
            f"({limits.max_num_seqs}): the beams run in the same steps; got {width}"
        )
    if not limits.num_blocks:
        return
    longest = len(token_ids) + search.max_new_tokens
    need = width * cdiv(longest, limits.block_size)
    if limits.kv_layout is not None:  # each beam, readmitted, recomputes chunk by chunk
        chunk = limits.max_chunk or longest
        need = width * limits.kv_layout.max_blocks_per_sequence(longest, chunk, limits.block_size)
    if need > limits.num_blocks:
        raise ValueError(
            f"best_of (the beam width; n when unset) is {width}: that many beams "
            f"of up to {longest:,} tokens need {need:,} KV cache blocks of "
            f"{limits.block_size} tokens, and the cache holds {limits.num_blocks:,}; lower "
            "best_of (or n) or max_tokens"
        )
