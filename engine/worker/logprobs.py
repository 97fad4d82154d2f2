"""Log-probabilities of chosen tokens and of each row's top tokens (prompt and sampled)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.outputs import Logprob, PromptLogprobs, SampleLogprobs  # noqa: F401 - re-exported


@dataclass(frozen=True)
class TokenLogprobs:
    """Batched logprobs of N rows: the chosen token of each row and the row's top K.

    Contract: `token_ranks` is 1 + the number of vocabulary entries with a strictly
    greater logprob; `topk_*` are sorted by descending logprob; K == 0 gives [N, 0]
    tensors. All tensors live on the device of the logits they came from.
    """

    token_logprobs: Tensor  # [N] float32
    token_ranks: Tensor  # [N] int64
    topk_ids: Tensor  # [N, K] int64
    topk_logprobs: Tensor  # [N, K] float32

    @property
    def num_top(self) -> int:
        return int(self.topk_ids.shape[1])

    def to(self, device: torch.device | str) -> TokenLogprobs:
        """A copy on `device` (e.g. "cpu" before building dicts)."""
        return TokenLogprobs(
            self.token_logprobs.to(device),
            self.token_ranks.to(device),
            self.topk_ids.to(device),
            self.topk_logprobs.to(device),
        )


def compute_token_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> TokenLogprobs:
    """log_softmax in float32 of `logits` [N, V]; picks `token_ids` [N] and the top `num_top`.

    K is `min(num_top, V)`, so a tiny test vocabulary never fails `topk`.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [N]
    k = min(num_top, logprobs.shape[1])
    if k > 0:
        topk_logprobs, topk_ids = torch.topk(logprobs, k, dim=1, sorted=True)  # [N, K]
    else:
        topk_logprobs = logprobs.new_empty((logprobs.shape[0], 0))
        topk_ids = token_ids.new_empty((logprobs.shape[0], 0))
    return TokenLogprobs(chosen.squeeze(1), ranks.to(torch.int64), topk_ids, topk_logprobs)


def to_dicts(
    tl: TokenLogprobs, token_ids: Tensor | Sequence[int], tops: Sequence[int]
) -> list[dict[int, Logprob]]:
    """One dict per row: the chosen token first, then the row's own top `tops[i]` tokens.

    Top entries get ranks 1..tops[i]; the chosen token keeps its true rank, so on ties it
    is not duplicated. `tops[i]` above K is cut to K (the rows asked for fewer).
    """
    if isinstance(token_ids, Tensor):
        token_ids = token_ids.tolist()
    if len(token_ids) != len(tops) or len(tops) != tl.token_logprobs.shape[0]:
        raise ValueError(
            f"to_dicts needs one token id and one top count per row: {len(token_ids)} ids, "
            f"{len(tops)} counts, {tl.token_logprobs.shape[0]} rows"
        )
    k = tl.num_top
    chosen_lp = tl.token_logprobs.tolist()
    chosen_rank = tl.token_ranks.tolist()
    top_ids = tl.topk_ids.tolist()
    top_lps = tl.topk_logprobs.tolist()
    rows: list[dict[int, Logprob]] = []
    for i, token_id in enumerate(token_ids):
        row = {int(token_id): Logprob(chosen_lp[i], chosen_rank[i])}
        for j in range(min(tops[i], k)):
            row.setdefault(top_ids[i][j], Logprob(top_lps[i][j], j + 1))
        rows.append(row)
    return rows
