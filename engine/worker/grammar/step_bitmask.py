"""One step's grammar mask: which sampling rows are constrained, and to what."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.worker.grammar.backend import GrammarBackend, GrammarMatcher

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GrammarBitmask:
    """Rows `rows` of a step's logits keep only the tokens their row of `bitmask`
    allows; the other rows are not touched. Built only for a step with a constrained
    row, so an unconstrained step allocates nothing."""

    bitmask: torch.Tensor  # [B, cdiv(V, 32)] int32, on the logits' device
    rows: list[int]
    backend: GrammarBackend

    def apply(self, logits: torch.Tensor) -> None:
        """Masks `logits` ([B, V] float32) in place."""
        self.backend.apply_bitmask(logits, self.bitmask, self.rows)


def step_bitmask(
    backend: GrammarBackend,
    matchers: Sequence[GrammarMatcher | None],
    device: torch.device | str,
) -> GrammarBitmask | None:
    """The mask of a step whose sampling row i has `matchers[i]` (None: unconstrained).
    A terminated matcher's row is left free: its sequence ended on a stop token, and
    the token planned past it (one step ahead) is thrown away whatever it is."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated]
    if not rows:
        return None
    bitmask = backend.allocate_bitmask(len(matchers))  # [B, cdiv(V, 32)] on the CPU
    for i in rows:
        matchers[i].fill_bitmask(bitmask, i)
    return GrammarBitmask(bitmask.to(device, non_blocking=True), rows, backend)
