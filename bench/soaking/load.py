"""Running requests under their deadline, and the client's record of how they ended."""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass, field
from typing import Any

from .context import Ctx
from .mix import KINDS, MALFORMED, Planned
from .outcome import HANG, Outcome, Tally, unexpected


@dataclass
class Client:
    """The client side's record: tallies per kind and, per malformed variant, counts
    per status."""

    tallies: dict[str, Tally] = field(default_factory=lambda: {k: Tally() for k in KINDS})
    variants: dict = field(
        default_factory=lambda: {k: collections.defaultdict(collections.Counter) for k in MALFORMED}
    )

    def add(self, request: Planned, outcome: Outcome) -> None:
        name = request.variant_name
        self.tallies[request.kind].add(outcome, request.label, name)
        if name:
            self.variants[request.kind][name][outcome.status] += 1

    def counts(self) -> tuple[int, int]:
        """(hangs, unexpected) so far."""
        t = self.tallies.values()
        return sum(x.hangs for x in t), sum(x.unexpected for x in t)


async def run_one(ctx: Ctx, kind: str, rng: random.Random, deadline: float, **kw: Any) -> Outcome:
    """One request under the deadline: no answer in time is a HANG; a client-side
    exception (refused connection, a reset) is UNEXPECTED. `kw`: the kind's own options
    (a malformed `variant`, a probe's `long`)."""
    ctx.in_flight += 1
    try:
        async with asyncio.timeout(deadline) as cm:
            return await KINDS[kind][1](ctx, rng, **kw)
    except TimeoutError:
        if cm.expired():
            return Outcome(HANG, f"no answer in {deadline:g} s")
        return unexpected("client TimeoutError")
    except Exception as exc:  # noqa: BLE001 - recorded per request
        return unexpected(f"client {type(exc).__name__}: {exc}")
    finally:
        ctx.in_flight -= 1
        ctx.answered += 1


async def run_requests(ctx: Ctx, requests: list[Planned], client: Client) -> None:
    """Runs the planned requests with at most --concurrency in flight, each with an rng
    of its own (seeded by --seed and its index)."""
    items = iter(requests)

    async def worker() -> None:
        for r in items:
            rng = random.Random(f"{ctx.args.seed}:{r.index}")
            kw = {} if r.variant is None else {"variant": r.variant}
            client.add(r, await run_one(ctx, r.kind, rng, ctx.args.deadline, **kw))

    await asyncio.gather(*(worker() for _ in range(ctx.args.concurrency)))
