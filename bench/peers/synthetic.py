"""The synthetic ShareGPT-shaped workload: lognormal input and output lengths, random
token ids, every request runs to its `max_tokens` (the llama.cpp comparison's 64 requests).

Lengths: input ~ lognormal(median 96, sigma 1.0) clipped to [4, 512], output ~
lognormal(median 96, sigma 0.8) clipped to [4, 256]; a pair longer than the context is
scaled down proportionally (keeping the minimums). Prompt ids are uniform in
[3, vocab) (0..2 are <unk>, <s>, </s> in Llama vocabularies), drawn from one
`random.Random(seed)` in request order, so a (seed, count, context, vocab) always gives
the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_TOKEN_ID = 3


@dataclass(frozen=True)
class LengthModel:
    """Lognormal length distributions, in tokens."""

    input_median: float = 96.0
    input_sigma: float = 1.0
    input_min: int = 4
    input_max: int = 512
    output_median: float = 96.0
    output_sigma: float = 0.8
    output_min: int = 4
    output_max: int = 256


def scale_to_fit(inp: int, out: int, max_len: int, in_min: int, out_min: int) -> tuple[int, int]:
    """Shrinks (inp, out) proportionally until inp + out <= max_len."""
    if inp + out <= max_len:
        return inp, out
    f = max_len / (inp + out)
    inp2 = max(in_min, math.floor(inp * f))
    out2 = max(out_min, max_len - inp2)
    if inp2 + out2 > max_len:
        raise ValueError(f"the minimum lengths ({in_min} + {out_min}) exceed the context {max_len}")
    return inp2, min(out2, out)


def sharegpt_shaped(
    num_requests: int,
    seed: int = 0,
    max_model_len: int = 1024,
    vocab_size: int = 32000,
    lengths: LengthModel = LengthModel(),
    max_output: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """(prompts as token-id lists, output lengths); `max_output` caps outputs (--quick)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    m = lengths
    for _ in range(num_requests):
        inp = round(rng.lognormvariate(math.log(m.input_median), m.input_sigma))
        out = round(rng.lognormvariate(math.log(m.output_median), m.output_sigma))
        inp = min(max(inp, m.input_min), m.input_max)
        out = min(max(out, m.output_min), m.output_max)
        inp, out = scale_to_fit(inp, out, max_model_len, m.input_min, m.output_min)
        prompts.append([rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(inp)])
        outs.append(out if max_output is None else min(out, max_output))
    return prompts, outs
