"""A request with several sequences (parallel sampling: `n`, `best_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.request import Request

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceGroup:
    """One client request sampled as `params.num_sequences` sequences.

    Each sequence is a `Request` of its own to the scheduler (its id from the schema's
    `sequence_id`, n=1, and seed + index when the request is seeded, so sequence i
    samples exactly what the same request with that seed samples alone). The first, the
    leader, is scheduled alone until its prompt is computed; the others (`held`) then
    join and fork the leader's prompt blocks, recomputing only the prompt's last token
    (into a private copy of its block) to sample their own first token: the prompt's KV
    is computed and stored once for all of them. Ranking best_of's sequences is the tokenizer's
    (engine/text/text_processor.py), which sees each one's logprobs.
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


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """What sequence `index` of a multi-sequence request samples with. With best_of the
    sampled tokens' logprobs are needed to rank the sequences (logprobs >= 0). Seeds are
    64-bit: seed + index wraps around 2**64, as the sampler reads seeds modulo 2**64."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    logprobs = params.logprobs
    if params.best_of is not None and logprobs is None:
        logprobs = 0
    return params.with_updates(n=1, best_of=None, seed=seed, logprobs=logprobs)
