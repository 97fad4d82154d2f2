"""Verification of draft tokens: the standard speculative sampling rule (Leviathan et al.
2023; Chen et al. 2023), exact in distribution.

For a row with K draft tokens x_1..x_K, the target model scored K + 1 positions: p_i is
its distribution for the token after the first i - 1 drafts (already processed: bias,
penalties, temperature, top-k/top-p/min-p, as the sampler would draw from), and q_i the
draft's (one-hot at x_i for a proposer without a distribution, such as prompt lookup).
Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order; at the first
rejection the row emits one token drawn from the residual max(0, p_i - q_i) renormalized
and stops; if all K are accepted it emits a bonus token drawn from p_{K+1}. Every
emitted token is then distributed exactly as plain sampling from the target would give.
Greedy rows accept a draft only if it is the target's argmax and emit the argmax where
they stop: token-identical to decoding without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MIN_NOISE = 1e-20  # keeps the exponential race finite if a draw is exactly 0
EMPTY = -1  # output slots past a row's last emitted token


@dataclass(frozen=True)
class Verification:
    """What `rejection_sample` gives back: `token_ids` [B, K + 1] int64, each row's
    emitted tokens first (accepted drafts, then the correction or bonus token), EMPTY
    after; `num_accepted` [B] int64, the drafts accepted (each row emits num_accepted + 1
    tokens)."""

    token_ids: Tensor
    num_accepted: Tensor


def rejection_sample(
    draft_token_ids: Tensor,  # [B, K] int64; a row's drafts first, any value after them
    num_drafts: Tensor,  # [B] int64 in [0, K]
    target_probs: Tensor,  # [B, K + 1, V] float32, each row sums to 1
    draft_probs: Tensor | None,  # [B, K, V] float32, or None: drafts are one-hot
    greedy: Tensor,  # [B] bool
    generator: torch.Generator | None = None,
) -> Verification:
    """The emitted tokens of every row (see the module docstring), vectorized over rows."""
    batch, k = draft_token_ids.shape
    positions = torch.arange(k, device=draft_token_ids.device)  # [K]
    has_draft = positions.unsqueeze(0) < num_drafts.unsqueeze(1)  # [B, K]
    drafts = torch.where(has_draft, draft_token_ids, 0)  # [B, K] safe to gather
    p = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        q = torch.ones_like(p)
    else:
        q = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    uniform = torch.rand(p.shape, generator=generator, device=p.device)  # [B, K]
    accept_random = uniform * q < p  # u < p / q, without dividing by q = 0
    accept_greedy = drafts == target_probs[:, :k].argmax(dim=2)  # [B, K]
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept_random) & has_draft
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] leading run
    last = _last_token(drafts, num_accepted, num_drafts, target_probs, draft_probs, greedy,
                       generator)  # fmt: skip
    out = torch.full((batch, k + 1), EMPTY, dtype=torch.int64, device=drafts.device)
    keep = positions.unsqueeze(0) < num_accepted.unsqueeze(1)  # [B, K]
    out[:, :k] = torch.where(keep, drafts, EMPTY)
    out.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
    return Verification(out, num_accepted)


def _last_token(
    drafts: Tensor,  # [B, K]
    num_accepted: Tensor,  # [B]
    num_drafts: Tensor,  # [B]
    target_probs: Tensor,  # [B, K + 1, V]
    draft_probs: Tensor | None,  # [B, K, V]
    greedy: Tensor,  # [B] bool
    generator: torch.Generator | None,
) -> Tensor:  # [B] int64: the correction (a draft was rejected) or bonus token
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    p = target_probs[rows, num_accepted]  # [B, V]: the position where the row stops
    rejected = num_accepted < num_drafts  # [B]
    at = num_accepted.clamp(max=drafts.shape[1] - 1) if drafts.shape[1] else num_accepted
    if draft_probs is None:
        q = torch.zeros_like(p)
        if drafts.shape[1]:
            q[rows, drafts[rows, at]] = 1.0
    else:
        q = draft_probs[rows, at] if drafts.shape[1] else torch.zeros_like(p)  # [B, V]
    residual = (p - q).clamp_min(0.0)  # [B, V]
    residual = torch.where(rejected.unsqueeze(1), residual, p)
    total = residual.sum(dim=1, keepdim=True)  # [B, 1]
    # A rejection leaves mass wherever p > q; if rounding leaves none, p itself is exact.
    residual = torch.where(total > 0, residual, p)
    noise = torch.empty_like(residual).exponential_(generator=generator).clamp_min_(_MIN_NOISE)
    sampled = (residual / noise).argmax(dim=1)  # [B]: a draw proportional to residual
    return torch.where(greedy, p.argmax(dim=1), sampled)
