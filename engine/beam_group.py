"""A beam search request: its running beams as scheduler sequences on shared blocks."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from engine.beam_search import BeamSearch, Hypothesis
from engine.request import Request, RequestStatus
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence_group import SequenceGroup, sequence_id


def beam_params(params: SamplingParams, num_candidates: int) -> SamplingParams:
    """What each beam runs with: greedy, its top `num_candidates` raw logprobs, and no
    stop rules of its own (the search decides when beams end)."""
    if num_candidates > MAX_LOGPROBS:
        raise ValueError(
            f"best_of={params.beam_width}: beam search ranks {num_candidates} continuations "
            f"per beam with this model's end tokens; at most {MAX_LOGPROBS} are supported, "
            "so lower best_of (the beam width)"
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
        """Beam `beam`'s continuations for this step; True when every beam has offered."""
        self.offers[beam.request_id] = top
        return len(self.offers) == len(self.running)

    def advance(self, scheduler: Scheduler, new_request: Callable[[str], Request]) -> bool:
        """One search step applied to the beams; True when the search is done."""
        generated = [tuple(b.output_token_ids) for b in self.running]
        top = [self.offers[b.request_id] for b in self.running]
        self.offers = {}
        nxt = self.search.step(generated, top)
        if self.search.done:
            for beam in self.running:
                scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_STOPPED)
            self.running = []
            self.hypotheses = self.search.results(self.params.n)
            return True
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
            else:
                seq = parent
            children[b.parent] = children.get(b.parent, 0) + 1
            beams.append((seq, b.token_id))
        for i, beam in enumerate(self.running):
            if i not in children:
                scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_STOPPED)
        for seq, token in beams:
            seq.output_token_ids.append(token)
        self.running = [seq for seq, _ in beams]
        return False

    @property
    def is_finished(self) -> bool:
        return self.search.done

    def results(self) -> list[Request]:
        """The beams still running (what an aborted search returns)."""
        return list(self.running)
