"""A request with several sequences (parallel sampling: `n`, `best_of`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from engine.core.request import Request

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


T = TypeVar("T")


def sequence_id(request_id: str, index: int) -> str:
    """The scheduler's id of sequence `index` of a multi-sequence request."""
    return f"{request_id}#{index}"


@dataclass(eq=False)
class SequenceGroup:
    """One client request sampled as `params.num_sequences` sequences.

    Each sequence is a `Request` of its own to the scheduler (its id from `sequence_id`,
    n=1, and seed + index when the request is seeded, so sequence i samples exactly what
    the same request with that seed samples alone). The first, the leader, is scheduled
    alone until its prompt is computed; the others (`held`) then join and fork the
    leader's prompt blocks, recomputing only the prompt's last token (into a private
    copy of its block) to sample their own first token: the prompt's KV is computed and
    stored once for all of them.
    """

    request_id: str
    params: SamplingParams
    preempt_together = False  # a class constant: parallel samples run independently
    chooses_tokens = False  # a class constant: True when the group, not sampling, picks
    # each next token (beam search), so planning ahead gives its sequences no placeholder
    sequences: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)  # not yet given to the scheduler

    @property
    def leader(self) -> Request:
        return self.sequences[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    def results(self) -> list[Request]:
        """The sequences to return, in output order: all n by index, or with best_of
        the n of highest cumulative logprob, best first."""
        if self.params.best_of is None or self.params.best_of == self.params.n:
            return list(self.sequences)
        return best_n(self.sequences, lambda s: s.cumulative_logprob, self.params.n)


def best_n(items: list[T], logprob: Callable[[T], float], n: int) -> list[T]:
    """best_of's rule: the `n` items of highest cumulative logprob, best first (ties in
    sampling order). The offline engine and the tokenizer actor both rank with it."""
    return sorted(items, key=logprob, reverse=True)[:n]


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """What sequence `index` of a multi-sequence request samples with. With best_of the
    sampled tokens' logprobs are needed to rank the sequences (logprobs >= 0). Seeds are
    64-bit: seed + index wraps around 2**64, as the sampler reads seeds modulo 2**64."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    logprobs = params.logprobs
    if params.best_of is not None and logprobs is None:
        logprobs = 0
    return params.with_updates(n=1, best_of=None, seed=seed, logprobs=logprobs)
