"""How many token slots a contiguous KV allocator reserves for a request up front."""

from __future__ import annotations

from enum import StrEnum


class ReservationPolicy(StrEnum):
    """The Orca baselines of the PagedAttention paper: one contiguous region per
    request, sized when it is admitted.

    - MAX: max_model_len tokens (Orca (Max)).
    - POW2: the prompt plus the next power of two >= the true output length (Orca
      (Pow2): 25 output tokens reserve 32 positions).
    - ORACLE: exactly the prompt plus the true output length (Orca (Oracle)).

    Every reservation is capped at max_model_len.
    """

    MAX = "contiguous-max"
    POW2 = "contiguous-pow2"
    ORACLE = "contiguous-oracle"


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()


def reservation_tokens(
    policy: ReservationPolicy, prompt_len: int, output_len: int, max_model_len: int
) -> int:
    """Token slots `policy` reserves for a request of `prompt_len` prompt tokens that
    will produce `output_len` tokens (its true output length)."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError(
            f"a request needs >= 1 prompt and >= 1 output token, got prompt_len={prompt_len}, "
            f"output_len={output_len}"
        )
    if prompt_len >= max_model_len:
        raise ValueError(
            f"prompt has {prompt_len:,} tokens; max_model_len is {max_model_len:,}, leaving "
            f"no room to generate; shorten it to at most {max_model_len - 1:,} tokens"
        )
    policy = ReservationPolicy(policy)
    if policy is ReservationPolicy.MAX:
        return max_model_len
    if policy is ReservationPolicy.POW2:
        return min(prompt_len + next_power_of_two(output_len), max_model_len)
    return min(prompt_len + output_len, max_model_len)
