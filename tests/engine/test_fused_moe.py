"""FusedMoE against a naive loop over tokens and their experts, per routing rule; the
checkpoint layouts it loads; its tensor-parallel slices summing to the whole."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from cuda_ext.reference import silu_and_mul
from engine.worker.models.fused_moe import (
    ExpertsLayout,
    FusedMoE,
    Routing,
    clamped_swiglu,
    per_expert_params,
)
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import Part

E, K, H, I = 5, 2, 16, 14  # experts, top-k, hidden, intermediate (7 per rank of 2)
GPT_OSS_ACT = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)


@dataclasses.dataclass
class Experts:
    """Whole (unsliced) expert weights, as a PER_EXPERT checkpoint holds them."""

    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    gate_bias: torch.Tensor | None = None  # [E, I]
    up_bias: torch.Tensor | None = None  # [E, I]
    down_bias: torch.Tensor | None = None  # [E, H]

    @classmethod
    def random(cls, seed: int, bias: bool = False) -> Experts:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        biases = (rand(E, I), rand(E, I), rand(E, H)) if bias else (None, None, None)
        return cls(rand(E, I, H), rand(E, I, H), rand(E, H, I), *biases)


class PartialSumGroup(TensorParallelGroup):
    """A rank whose all-reduce returns its own partial sum (the test adds the ranks')."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def naive_moe(hidden, logits, experts: Experts, routing: Routing, act_name: str):
    """Token by token, expert by expert, written from transformers' modules."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        if routing is Routing.TOPK_SOFTMAX:
            top, ids = torch.topk(logits[t], K)
            weights = torch.softmax(top, dim=-1)
        else:
            top, ids = torch.topk(torch.softmax(logits[t], dim=-1), K)
            renorm = routing is Routing.SOFTMAX_TOPK_RENORMALIZE
            weights = top / top.sum() if renorm else top
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            x = hidden[t]
            gate, up = experts.gate[e] @ x, experts.up[e] @ x
            if experts.gate_bias is not None:
                gate, up = gate + experts.gate_bias[e], up + experts.up_bias[e]
            if act_name == "silu":
                h = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = experts.down[e] @ h
            if experts.down_bias is not None:
                y = y + experts.down_bias[e]
            out[t] += w * y
    return out


def make_moe(
    experts: Experts,
    routing: Routing,
    act_name: str = "silu",
    layout: ExpertsLayout = ExpertsLayout.PER_EXPERT,
    group: TensorParallelGroup | None = None,
    local_experts: range | None = None,
) -> FusedMoE:
    group = group or TensorParallelGroup()
    moe = FusedMoE(
        num_experts=E,
        top_k=K,
        hidden_size=H,
        intermediate=Part.even(I, group, "intermediate_size"),
        routing=routing,
        activation=silu_and_mul if act_name == "silu" else GPT_OSS_ACT,
        layout=layout,
        group=group,
        bias=experts.gate_bias is not None,
        local_experts=local_experts,
    ).double()
    for name, tensor, part in checkpoint_tensors(experts, layout):
        moe.load(name, tensor, part)
    return moe


def checkpoint_tensors(experts: Experts, layout: ExpertsLayout):
    """(parameter name, tensor, part) as the loader hands them over, per layout."""
    if layout is ExpertsLayout.PER_EXPERT:
        for e in range(E):
            yield "gate_up_proj", experts.gate[e], 2 * e
            yield "gate_up_proj", experts.up[e], 2 * e + 1
            yield "down_proj", experts.down[e], e
        return
    interleaved = torch.stack([experts.gate, experts.up], dim=-2).reshape(E, 2 * I, H)
    yield "gate_up_proj", interleaved.transpose(1, 2), None  # [E, H, 2I], gate/up alternating
    yield "down_proj", experts.down.transpose(1, 2), None  # [E, I, H]
    if experts.gate_bias is not None:
        bias = torch.stack([experts.gate_bias, experts.up_bias], dim=-1).reshape(E, 2 * I)
        yield "gate_up_proj_bias", bias, None
        yield "down_proj_bias", experts.down_bias, None


def inputs(seed: int, tokens: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    return hidden, torch.randn(tokens, E, generator=g, dtype=torch.float64) * 2


CASES = {
    "mixtral": (Routing.SOFTMAX_TOPK_RENORMALIZE, "silu", ExpertsLayout.PER_EXPERT, False),
    "qwen3-moe-unnormalised": (Routing.SOFTMAX_TOPK, "silu", ExpertsLayout.PER_EXPERT, False),
    "gpt-oss": (Routing.TOPK_SOFTMAX, "clamped", ExpertsLayout.STACKED_INTERLEAVED, True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_a_naive_loop_over_tokens_and_experts(case: str) -> None:
    routing, act, layout, bias = CASES[case]
    experts = Experts.random(seed=1, bias=bias)
    hidden, logits = inputs(seed=2)
    moe = make_moe(experts, routing, act, layout)
    torch.testing.assert_close(
        moe(hidden, logits), naive_moe(hidden, logits, experts, routing, act)
    )


def test_the_clamp_bites_in_the_gpt_oss_case() -> None:
    """The clamped SwiGLU differs from an unclamped one on these weights (not vacuous)."""
    experts = Experts.random(seed=1, bias=True)
    hidden, _ = inputs(seed=2)
    gate = torch.einsum("eih,th->tei", experts.gate, hidden) + experts.gate_bias
    up = torch.einsum("eih,th->tei", experts.up, hidden) + experts.up_bias
    assert (gate > 7.0).any() and (up.abs() > 7.0).any()


def test_an_expert_that_gets_no_tokens_is_skipped() -> None:
    experts = Experts.random(seed=3)
    hidden, logits = inputs(seed=4)
    logits[:, 2] = -100.0  # nobody picks expert 2
    routing = Routing.SOFTMAX_TOPK_RENORMALIZE
    moe = make_moe(experts, routing)
    experts.gate[2].fill_(float("nan"))  # the naive loop would notice a use of it
    moe.gate_up_proj.data[2].fill_(float("nan"))  # and so would the sum
    torch.testing.assert_close(
        moe(hidden, logits), naive_moe(hidden, logits, experts, routing, "silu")
    )


def test_no_tokens_give_an_empty_output() -> None:
    moe = make_moe(Experts.random(seed=5), Routing.SOFTMAX_TOPK)
    hidden, logits = inputs(seed=6, tokens=0)
    assert moe(hidden, logits).shape == (0, H)


def test_tokens_whose_experts_live_elsewhere_get_zeros() -> None:
    """With a `local_experts` subset (expert parallelism), a token routed only to other
    experts gets nothing here; the local and the other experts' outputs sum to all."""
    experts = Experts.random(seed=7)
    hidden, logits = inputs(seed=8)
    logits[0, :] = torch.tensor([9.0, 8.0, -9.0, -9.0, -9.0], dtype=torch.float64)  # 0 and 1
    routing = Routing.SOFTMAX_TOPK_RENORMALIZE
    low = make_moe(experts, routing, local_experts=range(0, 2))
    high = make_moe(experts, routing, local_experts=range(2, E))
    assert low.gate_up_proj.shape[0] == 2 and high.gate_up_proj.shape[0] == 3
    torch.testing.assert_close(high(hidden, logits)[0], torch.zeros(H, dtype=torch.float64))
    whole = naive_moe(hidden, logits, experts, routing, "silu")
    torch.testing.assert_close(low(hidden, logits) + high(hidden, logits), whole)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_slices_sum_to_the_whole(case: str) -> None:
    routing, act, layout, bias = CASES[case]
    experts = Experts.random(seed=9, bias=bias)
    hidden, logits = inputs(seed=10)
    ranks = [make_moe(experts, routing, act, layout, PartialSumGroup(r, 2)) for r in range(2)]
    assert ranks[0].gate_up_proj.shape == (E, 2 * (I // 2), H)
    assert ranks[1].down_proj.shape == (E, H, I // 2)
    summed = ranks[0](hidden, logits) + ranks[1](hidden, logits)
    torch.testing.assert_close(summed, make_moe(experts, routing, act, layout)(hidden, logits))


def test_transformers_stacked_experts_load_like_per_expert_ones() -> None:
    """transformers 5 holds Mixtral's and Qwen3-MoE's experts stacked in memory:
    gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj [E, H, I]."""
    experts = Experts.random(seed=11)
    per_expert = make_moe(experts, Routing.SOFTMAX_TOPK, group=PartialSumGroup(1, 2))
    stacked = make_moe(Experts.random(seed=12), Routing.SOFTMAX_TOPK, group=PartialSumGroup(1, 2))
    stacked.load("gate_up_proj", torch.cat([experts.gate, experts.up], dim=1), None)
    stacked.load("down_proj", experts.down, None)
    torch.testing.assert_close(stacked.gate_up_proj, per_expert.gate_up_proj)
    torch.testing.assert_close(stacked.down_proj, per_expert.down_proj)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_named_clearly() -> None:
    moe = make_moe(Experts.random(seed=13), Routing.SOFTMAX_TOPK)
    with pytest.raises(ValueError, match=r"has shape \(14, 15\), the model expects \(14, 16\)"):
        moe.load("gate_up_proj", torch.zeros(I, H - 1), 0)


def test_per_expert_params_map_every_expert_tensor() -> None:
    params = per_expert_params(12, "w1", "w3", "w2")
    assert params[".experts.11.w3.weight"] == (".experts.gate_up_proj", 23)
    assert params[".experts.1.w2.weight"] == (".experts.down_proj", 1)
    assert len(params) == 36
