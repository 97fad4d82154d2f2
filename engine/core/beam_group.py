"""A beam search request: its running beams as scheduler sequences on shared blocks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.beam_search import BeamSearch, Hypothesis
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.sequence_group import SequenceGroup
from engine.messages import sequence_id
from engine.sampling_params import MAX_LOGPROBS, SamplingParams


def beam_search_for(
    params: SamplingParams,
    num_prompt_tokens: int,
    max_model_len: int,
    eos_token_ids: frozenset[int],
) -> BeamSearch:
    """The search a `use_beam_search` request runs: its width, length penalty and
    early-stopping rule; it ends on its stop token ids (and the model's end tokens unless
    `ignore_eos`) or after max_tokens (at most what the context leaves)."""
    ends = frozenset(params.stop_token_ids or ())
    if not params.ignore_eos:
        ends |= eos_token_ids
    room = max_model_len - num_prompt_tokens
    max_new = room if params.max_tokens is None else min(params.max_tokens, room)
    return BeamSearch(
        params.beam_width, params.length_penalty, params.early_stopping, max_new, ends
    )


def beam_params(params: SamplingParams, num_candidates: int) -> SamplingParams:
    """What each beam runs with: greedy, its top `num_candidates` raw logprobs, and no
    stop rules of its own (the search decides when beams end)."""
    if num_candidates > MAX_LOGPROBS:
        per_beam = num_candidates // params.beam_width
        raise ValueError(
            f"best_of (the beam width; n when unset) must be <= {MAX_LOGPROBS // per_beam} "
            f"here: each beam ranks {per_beam} continuations (2, or 1 + its number of end "
            f"tokens: stop_token_ids and the model's), at most {MAX_LOGPROBS} in all; "
            f"got {params.beam_width}"
        )
    return params.with_updates(
        n=1,
        best_of=None,
        use_beam_search=False,
        logprobs=num_candidates,
        ignore_eos=True,
        stop_token_ids=None,
        max_tokens=None,
    )


def top_offers(row: tuple, num_candidates: int) -> list[tuple[int, float]]:
    """A beam's continuations from its logprobs row on the wire (the sampled, greedy,
    token first with its true rank, then the top tokens by rank): (token, logprob) pairs,
    best first."""
    top = sorted(row, key=lambda c: c.rank)[:num_candidates]
    return [(c.token_id, c.logprob) for c in top]


@dataclass
class BeamMoves:
    """What one search step did to the beams: the ones that ended (pruned, or every beam
    when the search is done), the ones that go on as themselves with the token chosen
    for them, and the new forks (whose tokens are all known already)."""

    ended: list[Request] = field(default_factory=list)
    continued: list[tuple[Request, int]] = field(default_factory=list)
    forks: list[Request] = field(default_factory=list)


class BeamGroup(SequenceGroup):
    """The beams of one `use_beam_search` request, each a Request to the scheduler.

    Every step each running beam computes its newest token and offers its top K
    continuations (`collect`); once all have, `advance` runs one `BeamSearch` step: a
    beam chosen once continues as itself, one chosen again forks (sharing every block,
    copy-on-write before the next write), and one not chosen ends. When the search is
    done every beam ends and `hypotheses` holds the n best. The beams are one unit to
    the scheduler: preempted together, and admitted again only all at once.
    """

    preempt_together = True
    chooses_tokens = True

    def __init__(self, request_id: str, params: SamplingParams, search: BeamSearch) -> None:
        super().__init__(request_id, params)
        self.search = search
        self.running: list[Request] = []  # in the search's beam order
        self.offers: dict[str, list[tuple[int, float]]] = {}
        self.hypotheses: list[Hypothesis] = []
        self._ids = itertools.count(1)

    def start(self, leader: Request) -> None:
        leader.group = self
        self.sequences.append(leader)
        self.running.append(leader)

    def collect(self, beam: Request, top: list[tuple[int, float]]) -> bool:
        """Beam `beam`'s continuations for this step; True when every beam has offered.
        (A beam not running in the search, e.g. one pruned meanwhile, is ignored.)"""
        if beam in self.running:
            self.offers[beam.request_id] = top
        return len(self.offers) == len(self.running)

    def advance(self, scheduler: Scheduler, new_request: Callable[[str], Request]) -> BeamMoves:
        """One search step applied to the beams (`is_finished` tells when it was the last)."""
        generated = [tuple(b.output_token_ids) for b in self.running]
        top = [self.offers[b.request_id] for b in self.running]
        self.offers = {}
        nxt = self.search.step(generated, top)
        moves = BeamMoves()
        if self.search.done:
            for beam in self.running:
                scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_STOPPED)
            moves.ended = self.running
            self.running = []
            self.hypotheses = self.search.results(self.params.n)
            return moves
        children: dict[int, int] = {}
        beams = []
        for b in nxt:  # forks first, while every parent still holds only its own tokens
            parent = self.running[b.parent]
            if b.parent in children:
                seq = new_request(sequence_id(self.request_id, next(self._ids)))
                seq.output_token_ids = list(parent.output_token_ids)
                seq.group = self
                self.sequences.append(seq)
                scheduler.add_fork(seq, parent)
                moves.forks.append(seq)
            else:
                seq = parent
            children[b.parent] = children.get(b.parent, 0) + 1
            beams.append((seq, b.token_id))
        for i, beam in enumerate(self.running):
            if i not in children:
                scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_STOPPED)
                moves.ended.append(beam)
        forks = set(moves.forks)
        for seq, token in beams:
            seq.output_token_ids.append(token)
            if seq not in forks:
                moves.continued.append((seq, token))
        self.running = [seq for seq, _ in beams]
        return moves

    @property
    def is_finished(self) -> bool:
        return self.search.done
