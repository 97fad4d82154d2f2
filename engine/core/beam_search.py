"""Beam search over one request's running beams: which continuations live on, which
end as finished hypotheses, and when the search is done (Hugging Face's rules)."""

from __future__ import annotations

from dataclasses import dataclass

DEAD = -1.0e9  # HF's score offset for continuations that may not be chosen


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens, its raw summed logprob and its score
    (the sum divided by the generated length ** length_penalty)."""

    token_ids: tuple[int, ...]
    logprob: float
    score: float


@dataclass(frozen=True)
class NextBeam:
    """A running beam of the next step: beam `parent` of this step extended by `token_id`."""

    parent: int
    token_id: int
    logprob: float  # the new running score: the parent's plus the token's logprob


class BeamSearch:
    """Hugging Face `generate(num_beams=..., do_sample=False)`'s search, per request.

    Each step every running beam offers its top K continuations (token, logprob), K =
    (1 + number of end tokens) * width; the K best by running score + logprob are the
    candidates. A candidate that ends (an end token, or the length limit) and ranks in
    the first `width` becomes a hypothesis scored sum / generated_len ** length_penalty
    (unless the search can no longer improve); the `width` best candidates that do not
    end run on. The search stops when no running beam can beat the worst of `width`
    hypotheses (`early_stopping` False: by the current length's estimate; "never": by the
    longest possible one when length_penalty > 0), when `width` hypotheses exist and
    `early_stopping` is True, or when every candidate ends.
    """

    def __init__(
        self,
        width: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_new_tokens: int,
        end_token_ids: frozenset[int],
    ) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.end_token_ids = end_token_ids
        self.num_candidates = (1 + len(end_token_ids)) * width if end_token_ids else 2 * width
        self.num_candidates = max(self.num_candidates, 2 * width)
        self.running_logprobs = [0.0]  # one beam: the prompt
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.num_generated = 0
        self.can_improve = True
        self.done = False

    def step(
        self,
        generated: list[tuple[int, ...]],
        top: list[list[tuple[int, float]]],
    ) -> list[NextBeam]:
        """`generated[i]`: running beam i's tokens so far; `top[i]`: its top K
        (token, logprob), best first. Returns the next running beams (empty when done)."""
        candidates = sorted(
            (
                (self.running_logprobs[i] + lp, i, token)
                for i, row in enumerate(top)
                for token, lp in row[: self.num_candidates]
            ),
            key=lambda c: -c[0],
        )[: self.num_candidates]
        new_len = self.num_generated + 1
        ends = [t in self.end_token_ids or new_len >= self.max_new_tokens for _, _, t in candidates]
        self._finish(generated, candidates, ends, new_len)
        running = [c[0] + (DEAD if end else 0.0) for c, end in zip(candidates, ends, strict=True)]
        alive = sorted(range(len(candidates)), key=lambda j: -running[j])[: self.width]
        beams = [NextBeam(candidates[j][1], candidates[j][2], running[j]) for j in alive]
        self.running_logprobs = [b.logprob for b in beams]
        self.num_generated = new_len
        self._update_can_improve()
        full = len(self.finished) == self.width
        self.done = not self.can_improve or (full and self.early_stopping is True) or all(ends)
        return [] if self.done else beams

    def results(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

    def finish_reason(self, hypothesis: Hypothesis) -> str:
        """ "stop" for a hypothesis that ends with an end token, else "length"."""
        return "stop" if hypothesis.token_ids[-1] in self.end_token_ids else "length"

    def _finish(self, generated, candidates, ends, new_len: int) -> None:
        if len(self.finished) == self.width and self.early_stopping is True:
            return
        if not self.can_improve:
            return
        new = [
            Hypothesis(
                (*generated[beam], token),
                logprob,
                logprob / (new_len**self.length_penalty),
            )
            for rank, ((logprob, beam, token), end) in enumerate(zip(candidates, ends, strict=True))
            if end and rank < self.width
        ]
        merged = self.finished + new
        merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        self.finished = merged[: self.width]

    def _update_can_improve(self) -> None:
        if len(self.finished) < self.width:
            return  # an empty slot can always take a hypothesis
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = self.num_generated
        best_possible = self.running_logprobs[0] / (best_len**self.length_penalty)
        worst = min(h.score for h in self.finished)
        self.can_improve = self.can_improve and best_possible > worst
