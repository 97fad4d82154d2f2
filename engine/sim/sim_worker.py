"""`SimWorker`: the simulator's model-free worker, which also offers beam continuations."""

from __future__ import annotations

import random

from engine.core.scheduler_output import SchedulerOutput
from engine.outputs import Logprob
from engine.worker.model_output import LogprobDict, ModelOutput
from engine.worker.worker import NullWorker

FIRST_OFFER_ID = 1_000  # token ids of a row's offers: FIRST_OFFER_ID + rank - 1


class SimWorker(NullWorker):
    """A `NullWorker` whose rows that ask for logprobs (beam search's beams, which ask
    for their top K continuations) get a synthetic next-token distribution, so the
    search prunes and forks beams as it would on a model.

    Contract: every sampling row "samples" `token_id`, except rows asking for K
    logprobs, which sample their best offer and report K offers: the token ids
    FIRST_OFFER_ID.. in rank order, with logprobs drawn from a seeded generator in plan
    order: the best one -Exp(mean `top_gap`), each next one a further -Exp(mean
    `next_gap`) lower (with the defaults the best offer's probability averages 0.67 and
    the second's 0.33; the offers are not normalized, since the search only ranks sums of
    logprobs). The same plans give the same offers; how often beams fork and share
    follows from these draws, not from a model.
    """

    def __init__(
        self, token_id: int = 0, seed: int = 0, top_gap: float = 0.5, next_gap: float = 1.0
    ) -> None:
        super().__init__(token_id=token_id)
        if not (top_gap > 0 and next_gap > 0):
            raise ValueError(f"top_gap and next_gap must be > 0, got {top_gap} and {next_gap}")
        self.rng = random.Random(seed)
        self.top_gap, self.next_gap = top_gap, next_gap

    def _run(self, step: SchedulerOutput) -> ModelOutput:
        sampled, offers = {}, {}
        for s in step.scheduled:
            if not s.samples:
                continue
            rid, num_top = s.request.request_id, s.request.params.logprobs
            if num_top:
                offers[rid] = self._offers(num_top)
                sampled[rid] = FIRST_OFFER_ID
            else:
                sampled[rid] = self.token_id
        return ModelOutput(sampled, offers)

    def _offers(self, num_top: int) -> LogprobDict:
        """`num_top` offers, best first."""
        expovariate = self.rng.expovariate
        lp = -expovariate(1 / self.top_gap)
        offers = {FIRST_OFFER_ID: Logprob(lp, 1)}
        for rank in range(2, num_top + 1):
            lp -= expovariate(1 / self.next_gap)
            offers[FIRST_OFFER_ID + rank - 1] = Logprob(lp, rank)
        return offers
