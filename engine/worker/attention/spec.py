"""How one attention layer attends: the per-layer part of the backends' contract."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    """What differs between the attention layers of one model, fixed at construction.

    - `scale`: scores are `scale * q . k`.
    - `sliding_window`: None, or W: a query at position p sees only the keys at positions
      p - W < j <= p (Hugging Face's sliding-window mask; Mistral, Gemma's local layers,
      GPT-OSS's even layers). Backends read no key before the window.
    - `logit_soft_cap`: None, or c: scores become `c * tanh(scores / c)` before the mask
      and softmax (Gemma 2's attention soft-capping).
    - `has_sinks`: the layer passes learned per-head sink logits (GPT-OSS): each head's
      softmax denominator gets `exp(sink)` added, as if one more key scored `sink` and
      carried a zero value.
    """

    scale: float
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    has_sinks: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.logit_soft_cap is not None and self.logit_soft_cap <= 0:
            raise ValueError(f"logit_soft_cap must be > 0 or None, got {self.logit_soft_cap}")

    @property
    def features(self) -> tuple[str, ...]:
        """The optional features this layer uses, by name (for refusals)."""
        named = (
            ("sliding window", self.sliding_window is not None),
            ("attention logit soft-capping", self.logit_soft_cap is not None),
            ("attention sinks", self.has_sinks),
        )
        return tuple(name for name, used in named if used)

    def first_visible(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)
