"""Speculative verification (engine/worker/speculative/rejection_sampler.py).

Greedy rows: drafts kept while they are the target's argmax, then the argmax. Random
rows: the emitted tokens are distributed as plain sampling from the target, whatever
the draft. Checked on a 5-token vocabulary where the "models" are Markov chains (the
next token's distribution depends on the previous token): 200,000 rows, two tokens per
row (a row that emitted one token draws its second from the target, as the next step
would), the joint counts over the 25 pairs against the target's probabilities by a
chi-square test at a 1e-3 false-alarm rate; the same test rejects a sampler biased by 2
points on one token (its power is checked, not assumed)."""

from __future__ import annotations

import pytest
import torch

from engine.worker.speculative.rejection_sampler import EMPTY, rejection_sample

pytestmark = pytest.mark.timeout(120)

V = 5
ROWS = 200_000
CHI2_CRITICAL_24DF = 51.18  # P(chi2_24 > 51.18) = 1e-3
CHI2_CRITICAL_4DF = 18.47  # P(chi2_4 > 18.47) = 1e-3


def chain(seed: int) -> torch.Tensor:  # [V, V]: row a is the next token's distribution
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=gen) * 1.5, dim=1)


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    target = torch.zeros(3, 4, V)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [2, 2, 2, 2]])
    target.scatter_(2, argmax.unsqueeze(2), 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])
    out = rejection_sample(
        drafts, torch.tensor([3, 3, 3]), target, None, torch.ones(3, dtype=torch.bool)
    )
    assert out.token_ids.tolist() == [[1, 2, 3, 4], [1, 0, EMPTY, EMPTY], [2, EMPTY, EMPTY, EMPTY]]
    assert out.num_accepted.tolist() == [3, 1, 0]


def test_rows_with_fewer_drafts_and_none() -> None:
    target = torch.zeros(2, 3, V)
    target.scatter_(2, torch.tensor([[1, 2, 3], [4, 0, 0]]).unsqueeze(2), 1.0)
    drafts = torch.tensor([[1, 9], [0, 0]])  # row 0 has one draft (9 is padding)
    out = rejection_sample(
        drafts, torch.tensor([1, 0]), target, None, torch.ones(2, dtype=torch.bool)
    )
    assert out.token_ids.tolist() == [[1, 2, EMPTY], [4, EMPTY, EMPTY]]
    assert out.num_accepted.tolist() == [1, 0]


def speculative_pairs(
    target: torch.Tensor, draft: torch.Tensor | None, one_hot_drafts: torch.Tensor | None, seed: int
) -> torch.Tensor:
    """[ROWS, 2]: each row's first two tokens from state 0, with two drafts per row."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.zeros(ROWS, dtype=torch.int64)
    if draft is not None:
        x1 = torch.multinomial(draft[start], 1, generator=gen).squeeze(1)
        x2 = torch.multinomial(draft[x1], 1, generator=gen).squeeze(1)
        draft_probs = torch.stack([draft[start], draft[x1]], dim=1)  # [ROWS, 2, V]
    else:
        x1, x2 = one_hot_drafts[:, 0], one_hot_drafts[:, 1]
        draft_probs = None
    drafts = torch.stack([x1, x2], dim=1)  # [ROWS, 2]
    target_probs = torch.stack([target[start], target[x1], target[x2]], dim=1)  # [ROWS, 3, V]
    greedy = torch.zeros(ROWS, dtype=torch.bool)
    out = rejection_sample(drafts, torch.full((ROWS,), 2), target_probs, draft_probs, greedy, gen)
    first, second = out.token_ids[:, 0], out.token_ids[:, 1]
    plain = torch.multinomial(target[first], 1, generator=gen).squeeze(1)  # the next step
    second = torch.where(second == EMPTY, plain, second)
    return torch.stack([first, second], dim=1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def pair_counts(pairs: torch.Tensor) -> torch.Tensor:
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()


@pytest.mark.parametrize("kind", ["draft model", "one-hot drafts"])
def test_sampled_tokens_follow_the_target_distribution(kind: str) -> None:
    target, draft = chain(1), chain(2)
    joint = (target[0].unsqueeze(1) * target).reshape(-1).double()  # P(t1) P(t2 | t1)
    if kind == "draft model":
        pairs = speculative_pairs(target, draft, None, seed=3)
    else:
        fixed = torch.tensor([2, 3]).expand(ROWS, 2)  # prompt lookup's certain proposals
        pairs = speculative_pairs(target, None, fixed, seed=4)
    assert chi_square(pair_counts(pairs), joint) < CHI2_CRITICAL_24DF


def test_the_chi_square_test_detects_a_two_point_bias() -> None:
    """The power the distribution test relies on: ROWS draws from the target's first
    distribution moved by 2 points from its likeliest token to another fail it."""
    p = chain(1)[0].double()
    biased = p.clone()
    top = int(p.argmax())
    biased[top] -= 0.02
    biased[(top + 1) % V] += 0.02
    draws = torch.multinomial(
        biased.float(), ROWS, replacement=True, generator=torch.Generator().manual_seed(5)
    )
    assert chi_square(torch.bincount(draws, minlength=V).double(), p) > CHI2_CRITICAL_4DF
    fair = torch.multinomial(
        p.float(), ROWS, replacement=True, generator=torch.Generator().manual_seed(6)
    )
    assert chi_square(torch.bincount(fair, minlength=V).double(), p) < CHI2_CRITICAL_4DF


def test_acceptance_rate_is_the_overlap_of_the_two_distributions() -> None:
    """The chance that the first draft is accepted is sum_x min(p(x), q(x))."""
    target, draft = chain(1), chain(2)
    gen = torch.Generator().manual_seed(7)
    rows = 100_000
    x1 = torch.multinomial(draft[0].expand(rows, V), 1, generator=gen)  # [rows, 1]
    target_probs = torch.stack([target[0].expand(rows, V), target[x1.squeeze(1)]], dim=1)
    out = rejection_sample(
        x1,
        torch.ones(rows, dtype=torch.int64),
        target_probs,
        draft[0].expand(rows, 1, V),
        torch.zeros(rows, dtype=torch.bool),
        gen,
    )
    overlap = float(torch.minimum(target[0], draft[0]).sum())
    assert float(out.num_accepted.double().mean()) == pytest.approx(overlap, abs=0.01)


def test_greedy_and_random_rows_share_a_batch() -> None:
    target = torch.softmax(torch.randn(2, 3, V, generator=torch.Generator().manual_seed(8)), dim=2)
    drafts = target[:, :2].argmax(dim=2)  # the greedy row's drafts are all right
    greedy = torch.tensor([True, False])
    out = rejection_sample(drafts, torch.tensor([2, 2]), target, None, greedy)
    assert out.token_ids[0].tolist() == [*drafts[0].tolist(), int(target[0, 2].argmax())]
    assert 0 <= int(out.num_accepted[1]) <= 2
    emitted = out.token_ids[1][: int(out.num_accepted[1]) + 1]
    assert (emitted >= 0).all() and (emitted < V).all()
