"""Small scheduling policies, kept out of `Scheduler.schedule()`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.request import Request


class PreemptionPolicy:
    """Chooses which running request gives its blocks back when blocks run out."""

    def choose_victim(self, running: Sequence[Request]) -> Request:
        raise NotImplementedError


class LatestArrivalFirst(PreemptionPolicy):
    """Preempt the most recently arrived request (it has waited least)."""

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: r.arrival_index)
