"""How many draft tokens a decoding sequence may verify in one step: its lookahead."""

from __future__ import annotations

from engine.core.request import Request


class LookaheadPolicy:
    """Decides each decoding row's lookahead k: the slots the scheduler reserves for the
    draft tokens a worker proposes and verifies in the same step (`num_speculative_tokens`).

    A row may speculate when its request is past its prompt, decodes one token this
    step, and samples freely: no grammar (structured outputs), no beam search, and
    greedy or unseeded (a seeded random request keeps its exact seeded output).

    The batch rule turns it down: with more than `max_batch` sequences running no row
    speculates. Verifying k more positions per row costs little while a step is bound
    by reading the weights, and more than it saves once the step is bound by arithmetic
    (a CPU's integer kernels get there from a few rows) or by the host's work per row
    (docs/speculative_decoding.md has the figures behind the default of 1).
    """

    def __init__(self, num_speculative_tokens: int, max_batch: int | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.max_batch = max_batch

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
        return self.k
