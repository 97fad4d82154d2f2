"""How one request ended, and the counts of one request kind."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

RESULT, ERROR, UNEXPECTED, HANG = "result", "error", "unexpected", "hang"
EXAMPLES_PER_KIND = 5
_COUNTER = {RESULT: "results", ERROR: "errors", UNEXPECTED: "unexpected", HANG: "hangs"}


@dataclass(frozen=True)
class Outcome:
    """How one request ended: RESULT (completed as expected), ERROR (the expected error
    answer), UNEXPECTED or HANG; `note` says which way (counted per kind)."""

    status: str
    note: str = ""


def ok(note: str = "") -> Outcome:
    return Outcome(RESULT, note)


def expected_error(note: str = "") -> Outcome:
    return Outcome(ERROR, note)


def unexpected(note: str) -> Outcome:
    return Outcome(UNEXPECTED, note)


@dataclass
class Tally:
    """Counts of one request kind: one counter per status, the notes of the expected
    outcomes, and up to EXAMPLES_PER_KIND distinct unexpected answers and hangs."""

    results: int = 0
    errors: int = 0
    unexpected: int = 0
    hangs: int = 0
    notes: collections.Counter = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)  # distinct unexpected answers, hangs
    _seen: set = field(default_factory=set, repr=False)

    def add(self, outcome: Outcome, label: str, variant: str = "") -> None:
        attr = _COUNTER[outcome.status]
        setattr(self, attr, getattr(self, attr) + 1)
        if outcome.status in (RESULT, ERROR):
            self.notes[outcome.note or outcome.status] += 1
            return
        key = (variant, outcome.status, outcome.note[:60])
        if key not in self._seen and len(self.examples) < EXAMPLES_PER_KIND:
            self._seen.add(key)
            self.examples.append(f"{label}: {outcome.status}: {outcome.note}"[:300])

    @property
    def total(self) -> int:
        return self.results + self.errors + self.unexpected + self.hangs

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return out | {"total": self.total, "notes": dict(self.notes.most_common())}
