"""How many draft tokens a decoding sequence may verify in one step: its lookahead."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request


@dataclass
class _Acceptance:
    """One request's recent share of accepted drafts, and steps left in a cool-down."""

    share: float = 1.0
    cooldown: int = 0


class LookaheadPolicy:
    """Decides each decoding row's lookahead k: the slots the scheduler reserves for the
    draft tokens a worker proposes and verifies in the same step (up to
    `num_speculative_tokens`), and turns speculation down where it does not pay.

    A row may speculate when its request is past its prompt, decodes one token this
    step, and samples freely: no grammar (structured outputs), no beam search, and
    greedy or unseeded (a seeded random request keeps its exact seeded output).

    Two rules turn it down (both off by default, see docs/speculative_decoding.md):
      - batch: with more than `max_batch` sequences running no row speculates; a step
        over many sequences is bound by compute rather than by reading the weights, so
        the extra positions cost about what they save.
      - acceptance: each request keeps an exponential average of the share of its drafts
        accepted (weight `smoothing` on the newest step); below `min_acceptance` it stops
        speculating for `cooldown` steps, then tries again (text that stopped repeating
        may repeat again).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_batch: int | None = None,
        min_acceptance: float = 0.0,
        cooldown: int = 16,
        smoothing: float = 0.5,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.cooldown = cooldown
        self.smoothing = smoothing
        self._acceptance: dict[str, _Acceptance] = {}

    def lookahead(self, request: Request, num_running: int) -> int:
        """Draft slots for `request`'s decoding row this step (0: no speculation)."""
        if self.max_batch is not None and num_running > self.max_batch:
            return 0
        params = request.params
        if (
            request.num_computed_tokens < len(request.prompt_token_ids)
            or params.structured_outputs is not None
            or (request.group is not None and request.group.chooses_tokens)
            or (params.seed is not None and not params.is_greedy)
        ):
            return 0
        state = self._acceptance.get(request.request_id)
        if state is not None and state.cooldown > 0:
            state.cooldown -= 1
            return 0
        return self.k

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of `request_id`, accepting `num_accepted`."""
        if num_drafts == 0 or self.min_acceptance <= 0.0:
            return
        state = self._acceptance.setdefault(request_id, _Acceptance())
        a = self.smoothing
        state.share = (1 - a) * state.share + a * num_accepted / num_drafts
        if state.share < self.min_acceptance:
            state.cooldown, state.share = self.cooldown, 1.0  # a fresh start after it

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
