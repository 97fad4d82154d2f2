"""The request kinds by weight, and the seeded plan of a run."""

from __future__ import annotations

import argparse
import collections
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .context import Ctx
from .http_kinds import http_abandon, http_oversize, http_plain, sse_disconnect, sse_stream
from .malformed import BAD_BODIES, BAD_FRAMES, http_malformed, ws_malformed
from .outcome import Outcome
from .ws_kinds import ws_cancel, ws_disconnect, ws_json, ws_msgpack, ws_oversize, ws_session

KINDS: dict[str, tuple[float, Callable[[Ctx, random.Random], Awaitable[Outcome]]]] = {
    "ws_json": (14, ws_json),
    "ws_msgpack": (8, ws_msgpack),
    "ws_cancel": (6, ws_cancel),
    "ws_disconnect": (5, ws_disconnect),
    "ws_session": (6, ws_session),
    "ws_oversize": (2, ws_oversize),
    "ws_malformed": (6, ws_malformed),
    "sse_stream": (10, sse_stream),
    "sse_disconnect": (5, sse_disconnect),
    "http_plain": (10, http_plain),
    "http_abandon": (5, http_abandon),
    "http_oversize": (2, http_oversize),
    "http_malformed": (6, http_malformed),
}
MALFORMED = {"ws_malformed": BAD_FRAMES, "http_malformed": BAD_BODIES}  # kind -> variants
QUICK_MALFORMED_WEIGHTS = {"ws_malformed": 14, "http_malformed": 10}  # ~each variant once


def parse_weights(text: str | None) -> dict[str, float]:
    """The default weights of KINDS, overridden by `kind=weight,...`."""
    weights = {kind: w for kind, (w, _) in KINDS.items()}
    for item in filter(None, (text or "").split(",")):
        kind, _, value = item.partition("=")
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        weights[kind] = float(value)
    return weights


@dataclass(frozen=True)
class Planned:
    """Request `index` of the run: its kind, and for a malformed kind the variant."""

    index: int
    kind: str
    variant: int | None = None

    @property
    def variant_name(self) -> str:
        """The malformed variant's name ("" for the other kinds)."""
        return "" if self.variant is None else MALFORMED[self.kind][self.variant].name

    @property
    def label(self) -> str:
        if self.variant is None:
            return f"#{self.index}"
        return f"#{self.index} {self.variant_name}"


def plan(n: int, weights: dict[str, float], seed: int) -> list[Planned]:
    """`n` kinds drawn by weight; the malformed kinds go through their variants in turn
    (in a seeded order), so every variant is sent once before any is sent twice."""
    rng = random.Random(seed)
    kinds = [k for k, w in weights.items() if w > 0]
    orders = {k: rng.sample(range(len(v)), len(v)) for k, v in MALFORMED.items()}
    seen: collections.Counter = collections.Counter()
    out = []
    for i, kind in enumerate(rng.choices(kinds, [weights[k] for k in kinds], k=n)):
        variant = None
        if kind in MALFORMED:
            variant = orders[kind][seen[kind] % len(orders[kind])]
            seen[kind] += 1
        out.append(Planned(i, kind, variant))
    return out
