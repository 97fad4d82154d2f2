"""Request traces for the simulator: who arrives when, with how many prompt tokens, and
how many tokens they will generate (the true output length, known to the trace)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request: `arrival_s` on the virtual clock, its prompt (`prompt_len` tokens;
    `prompt_token_ids` when a test or a prefix-sharing workload needs real ids, else
    synthetic distinct ids are made), and `output_len` tokens to generate (EOS ignored).
    `n`/`best_of`/`beam_width` for parallel sampling and beam search (1: plain)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    n: int = 1
    beam_width: int = 1

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"{self.request_id}: prompt_len and output_len must be >= 1, "
                f"got {self.prompt_len} and {self.output_len}"
            )


def poisson_trace(
    lengths: Sequence[tuple[int, int]],
    rate: float,
    num_requests: int,
    seed: int = 0,
    max_len: int | None = None,
) -> list[TraceRequest]:
    """`num_requests` requests arriving as a Poisson process of `rate` requests/s, each
    with (prompt_len, output_len) drawn from `lengths` (with replacement, seeded). With
    `max_len`, prompts are cut to leave room for 1 output token and outputs to fit."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not lengths:
        raise ValueError("lengths is empty")
    rng = random.Random(seed)
    clock, trace = 0.0, []
    for i in range(num_requests):
        clock += rng.expovariate(rate)
        prompt, output = lengths[rng.randrange(len(lengths))]
        if max_len is not None:
            prompt = min(prompt, max_len - 1)
            output = min(output, max_len - prompt)
        trace.append(TraceRequest(f"r{i}", clock, prompt, output))
    return trace
