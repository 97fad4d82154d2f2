"""Request traces for the simulator: who arrives when, with how many prompt tokens, and
how many tokens they will generate (the true output length, known to the trace)."""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

SYNTHETIC_VOCAB = 30_000


@dataclass(frozen=True)
class TraceRequest:
    """One request: `arrival_s` on the virtual clock, its prompt (`prompt_len` tokens;
    `prompt_token_ids` when a test or a prefix-sharing workload needs real ids, else
    synthetic distinct ids are made), and `output_len` tokens to generate (EOS ignored).
    `n` > 1: parallel sampling, n sequences sharing the prompt; with `use_beam_search`,
    a beam search of width `n` for `output_len` tokens instead. With
    `prefix_hashes`, the prompt is `hashed_prompt(prefix_hashes, prompt_len)`, made when
    the request is admitted (a long trace holds no token ids until then)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    n: int = 1
    prefix_hashes: tuple[int, ...] = ()  # `hashed_prompt` blocks (a trace's shared prefixes)
    use_beam_search: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"{self.request_id}: prompt_len and output_len must be >= 1, "
                f"got {self.prompt_len} and {self.output_len}"
            )

    def token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids: the given ones; else `hashed_prompt` of its prefix
        hashes; else ids distinct per request (no accidental prefix sharing)."""
        if self.prefix_hashes:
            return hashed_prompt(self.prefix_hashes, self.prompt_len)
        if self.prompt_token_ids:
            return self.prompt_token_ids
        seed = zlib.crc32(self.request_id.encode())
        return tuple(
            100 + (seed * 7919 + i * 104_729) % SYNTHETIC_VOCAB for i in range(self.prompt_len)
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


def _synthetic_run(label: str, length: int) -> tuple[int, ...]:
    """`length` synthetic token ids, the same for the same `label`."""
    seed = zlib.crc32(label.encode())
    return tuple(100 + (seed + i * 7919) % SYNTHETIC_VOCAB for i in range(length))


@lru_cache(maxsize=65_536)
def _hash_block(hash_id: int, tokens_per_hash: int) -> tuple[int, ...]:
    return _synthetic_run(f"block {hash_id}", tokens_per_hash)


def hashed_prompt(
    hashes: Sequence[int], length: int, tokens_per_hash: int = 512
) -> tuple[int, ...]:
    """`length` token ids where equal hash ids give equal runs of `tokens_per_hash`
    tokens, in order (a trace's prefix block hashes, e.g. Mooncake's 512-token ones),
    so prompts sharing leading hashes share a prefix and nothing else."""
    ids: list[int] = []
    for hash_id in hashes:
        if len(ids) >= length:
            break
        ids.extend(_hash_block(hash_id, tokens_per_hash))
    if len(ids) < length:  # longer than its hashes cover: a tail of its own
        ids.extend(_hash_block(-1 - len(hashes) * 1_000_003 - length, length - len(ids)))
    return tuple(ids[:length])


def with_shared_prefix(trace: Sequence[TraceRequest], prefix_len: int) -> list[TraceRequest]:
    """The requests of `trace` with the same `prefix_len` tokens (a few-shot prompt)
    put before each one's own prompt (`prompt_len` grows by `prefix_len`)."""
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
    prefix = _synthetic_run("shared prefix", prefix_len)
    return [
        dataclasses.replace(
            r,
            prompt_len=prefix_len + r.prompt_len,
            prompt_token_ids=prefix + r.token_ids(),
            prefix_hashes=(),  # the ids above already hold them
        )
        for r in trace
    ]


def replayed_trace(
    records: Sequence[tuple[float, int, int, tuple[int, ...]]],
    speedup: float,
    max_len: int,
) -> list[TraceRequest]:
    """A recorded trace's requests ((arrival s, prompt len, output len, prefix hashes)),
    arriving `speedup` times faster. To fit `max_len`, a prompt keeps its first tokens,
    leaving room for its output up to a quarter of `max_len`, and the output is cut to
    what is left."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    trace = []
    for i, (arrival, prompt, output, hashes) in enumerate(records):
        prompt = min(prompt, max_len - max(1, min(output, max_len // 4)))
        output = max(1, min(output, max_len - prompt))
        trace.append(TraceRequest(f"m{i}", arrival / speedup, prompt, output, prefix_hashes=hashes))
    return trace
