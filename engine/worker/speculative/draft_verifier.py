"""Verification of a step's draft tokens against the target model's own logits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from engine.worker.sampler import Sampler
from engine.worker.sampling_metadata import SamplingMetadata, SamplingRow
from engine.worker.speculative.rejection_sampler import EMPTY, Verification, rejection_sample


class DraftVerifier:
    """Turns the logits of a step's speculating rows into the tokens they emit.

    A row verifying d drafts D after its known tokens has d + 1 logit rows: position i
    (0..d) scores the token after the known tokens and D[:i]. Each position is processed
    exactly as the sampler processes a plain row whose outputs end with D[:i] (logit
    bias, the min_tokens mask, penalties counted over those outputs; then temperature,
    top-k, top-p and min-p for a random row), and `rejection_sample` accepts a leading
    run of drafts and draws the token after it: a greedy row emits what plain greedy
    decoding would, token for token; a random row's tokens are distributed exactly as
    plain sampling's. Rows are never seeded random ones (their seeded noise is kept to
    plain sampling; the scheduler gives them no lookahead).
    """

    def __init__(
        self, vocab_size: int, device: str | torch.device, generator: torch.Generator | None
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = generator

    def verify(
        self,
        logits: Tensor,  # [sum(d_b + 1), V]: each row's d_b + 1 positions, rows in order
        rows: Sequence[SamplingRow],
        drafts: Sequence[Sequence[int]],
    ) -> Verification:
        """Each row's emitted tokens (`Verification`: [B, K + 1], K the most drafts)."""
        positions = [
            dataclasses.replace(row, output_token_ids=[*row.output_token_ids, *d[:i]])
            for row, d in zip(rows, drafts, strict=True)
            for i in range(len(d) + 1)
        ]
        md = SamplingMetadata.from_rows(positions, self.vocab_size, self.device)
        x = Sampler.process_logits(logits, md)  # [R, V]
        if md.all_greedy:
            return self._greedy(x.argmax(dim=-1).tolist(), drafts)
        # greedy rows keep their logits: the argmax is plain decoding's
        x = torch.where(md.greedy.unsqueeze(1), x, Sampler.probabilities(x, md))
        batch, k = len(rows), max(len(d) for d in drafts)
        dev = self.device
        row_of = [b for b, d in enumerate(drafts) for _ in range(len(d) + 1)]
        row_of = torch.tensor(row_of, device=dev)
        pos_of = torch.tensor([i for d in drafts for i in range(len(d) + 1)], device=dev)
        target = x.new_zeros((batch, k + 1, self.vocab_size))  # [B, K + 1, V]
        target[row_of, pos_of] = x
        draft_ids = torch.tensor(
            [[*d, *[0] * (k - len(d))] for d in drafts], dtype=torch.int64, device=dev
        ).view(batch, k)  # [B, K]
        num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=dev)
        greedy = torch.tensor([row.params.is_greedy for row in rows], device=dev)  # [B]
        return rejection_sample(draft_ids, num_drafts, target, None, greedy, self.generator)

    def _greedy(self, best: list[int], drafts: Sequence[Sequence[int]]) -> Verification:
        """Every row greedy: a draft is accepted while it is the argmax (`best`, one per
        position, rows in order), then the argmax where the run stops is emitted."""
        k = max(len(d) for d in drafts)
        rows, accepted, start = [], [], 0
        for d in drafts:
            j = 0
            while j < len(d) and d[j] == best[start + j]:
                j += 1
            rows.append([*d[:j], best[start + j], *[EMPTY] * (k - j)])
            accepted.append(j)
            start += len(d) + 1
        dev = self.device
        return Verification(
            torch.tensor(rows, dtype=torch.int64, device=dev),  # [B, K + 1]
            torch.tensor(accepted, dtype=torch.int64, device=dev),  # [B]
        )
