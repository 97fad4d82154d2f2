"""Mixture of experts as one op (vLLM's `FusedMoE`): routing, grouped expert GEMMs and
the weighted combine, over all experts' weights stacked in one tensor per projection.

Each token's router logits pick `top_k` experts and their weights (`Routing`, the
family's rule); the (token, expert) assignments are sorted by expert once, so each
expert runs two GEMMs over the rows of the tokens it got (a loop over the experts that
received tokens, never over tokens), and the weighted outputs are summed back into
their tokens with one `index_add_`. The per-token sum runs over experts in ascending
order, as transformers' loop does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.parallel.collectives import share_bounds
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import Part, check_shape


class Routing(Enum):
    """How a token's router logits [E] become its top-k experts and their weights."""

    SOFTMAX_TOPK = "softmax-topk"  # Qwen3-MoE without norm_topk_prob
    SOFTMAX_TOPK_RENORMALIZE = "softmax-topk-renormalize"  # Mixtral; Qwen3-MoE norm_topk_prob
    TOPK_SOFTMAX = "topk-softmax"  # GPT-OSS: softmax over the k largest logits

    def select(
        self, logits: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (weights, float32 or wider; ids), [T, k] each
        dtype = torch.promote_types(logits.dtype, torch.float32)
        if self is Routing.TOPK_SOFTMAX:
            top, ids = torch.topk(logits, top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=dtype)
        top, ids = torch.topk(probs, top_k, dim=-1)
        if self is Routing.SOFTMAX_TOPK_RENORMALIZE:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, ids


class ExpertsLayout(Enum):
    """How a checkpoint stores the experts' weights (E experts, I intermediate, H hidden).

    - PER_EXPERT: one `[out, in]` tensor per expert and projection (Mixtral's
      `experts.{e}.w1/w3/w2`, Qwen3-MoE's `experts.{e}.gate_proj/up_proj/down_proj`;
      `per_expert_params` maps their names), or, as transformers 5 holds them in memory,
      `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj` [E, H, I].
    - STACKED_INTERLEAVED: GPT-OSS's `gate_up_proj` [E, H, 2I] with gate and up
      alternating on the last dim (`[..., ::2]`, `[..., 1::2]`), `gate_up_proj_bias`
      [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias` [E, H].
    """

    PER_EXPERT = "per-expert"
    STACKED_INTERLEAVED = "stacked-interleaved"


Activation = Callable[[torch.Tensor], torch.Tensor]  # [n, 2 * i] (gate | up) -> [n, i]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation (transformers' `GptOssExperts._apply_gate`) on [gate | up]:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def per_expert_params(
    num_experts: int, gate: str, up: str, down: str
) -> dict[str, tuple[str, int]]:
    """`CausalLM.stacked_params` entries for a PER_EXPERT checkpoint: expert e's gate and
    up tensors fill parts 2e and 2e + 1 of `experts.gate_up_proj`, its down tensor part
    e of `experts.down_proj` (e.g. gate, up, down = "w1", "w3", "w2" for Mixtral)."""
    params: dict[str, tuple[str, int]] = {}
    for e in range(num_experts):
        params[f".experts.{e}.{gate}.weight"] = (".experts.gate_up_proj", 2 * e)
        params[f".experts.{e}.{up}.weight"] = (".experts.gate_up_proj", 2 * e + 1)
        params[f".experts.{e}.{down}.weight"] = (".experts.down_proj", e)
    return params


def expert_share(num_experts: int, group: TensorParallelGroup) -> range:
    """Rank r's experts under expert parallelism: a contiguous share, sizes differing
    by at most one."""
    r, world = group.rank, group.world_size
    return range(r * num_experts // world, (r + 1) * num_experts // world)


class FusedMoE(nn.Module):
    """All experts of one MoE layer: `forward(hidden [T, H], router_logits [T, E]) ->
    [T, H]`, routing by `routing`, expert MLPs down(activation(gate_up(x))).

    Weights, stacked over this rank's experts and named as transformers names stacked
    experts (GPT-OSS's checkpoint): `gate_up_proj` (vLLM's w13) [experts, 2 * I / world,
    H], this rank's gate rows then its up rows; `down_proj` (w2) [experts, H, I / world];
    with `bias`, `gate_up_proj_bias` [experts, 2 * I / world] and `down_proj_bias`
    [experts, H]. `load(name, tensor, part)` takes checkpoint tensors in `layout`.

    Tensor parallelism: every expert is sliced along its intermediate dim (`intermediate`,
    this rank's Part of I): gate_up column-parallel, down row-parallel, and the combined
    output of all experts is all-reduced once; down's bias is added on the first rank only.

    Expert parallelism (`group.expert_parallel`): whole experts are placed on the ranks
    instead, a contiguous share each (`local_experts`, the experts whose weights this rank
    holds, unsliced); every rank routes every token (the router is replicated), computes
    the assignments to its own experts, adds their down bias, and the same all-reduce
    sums the ranks' parts into each token. Each expert's weights live on one rank: the
    MoE layers' weights are divided by the ranks as with slicing, and an expert's GEMMs
    run whole. With `group.expert_all_to_all` the tokens travel instead: each rank takes
    a contiguous share of them, sends every (token, expert) assignment's hidden state to
    the expert's rank and gets its output back (two all-to-alls), combines its share and
    the ranks all-gather the shares (in place of the all-reduce). `tokens_per_expert`
    [num_experts] counts the assignments each expert got so far (the load per expert;
    every rank routes every token, so each rank has all of it).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate: Part,
        routing: Routing,
        activation: Activation,
        layout: ExpertsLayout,
        group: TensorParallelGroup,
        bias: bool = False,
        local_experts: range | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate, self.routing, self.activation = intermediate, routing, activation
        self.layout, self.group = layout, group
        if group.expert_parallel:
            intermediate = self.intermediate = Part(intermediate.full, 0, intermediate.full)
            if local_experts is None:
                local_experts = expert_share(num_experts, group)
        self.local_experts = local_experts if local_experts is not None else range(num_experts)
        n, i = len(self.local_experts), intermediate.size
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n, hidden_size, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n, 2 * i)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(n, hidden_size)) if bias else None
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), False
        )
        self.checkpoint_parts = (
            {"gate_up_proj": 2 * num_experts, "down_proj": num_experts}
            if layout is ExpertsLayout.PER_EXPERT
            else None
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        router_logits: torch.Tensor,  # [T, num_experts]
    ) -> torch.Tensor:  # [T, hidden_size], summed over the ranks
        weights, experts = self.routing.select(router_logits, self.top_k)  # [T, k] each
        flat = experts.reshape(-1)  # [T * k], assignment a = token * k + slot
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.tokens_per_expert += counts
        if self.group.expert_all_to_all and self.group.is_parallel:
            return self._dispatched(hidden, weights, experts)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        local = self.local_experts
        bounds = list(itertools.accumulate(counts.tolist(), initial=0))  # e: [bounds[e], [e+1])
        lo, hi = bounds[local.start], bounds[local.stop]  # this rank's experts' assignments
        mine = order[lo:hi]
        token = mine // self.top_k  # [n] the token of each assignment
        x = hidden[token]  # [n, hidden_size]
        y = torch.empty_like(x)
        for e in local:
            start, end = bounds[e] - lo, bounds[e + 1] - lo
            if start < end:
                y[start:end] = self._expert(e - local.start, x[start:end])
        y.mul_(weights.reshape(-1)[mine].unsqueeze(1))
        out = torch.zeros_like(hidden).index_add_(0, token, y)
        return self.group.all_reduce(out)

    def _dispatched(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:  # [T, hidden_size]
        """Expert parallelism by all-to-all: this rank's contiguous share of the tokens
        sends each (token, expert) assignment's hidden state to the rank holding the
        expert, which runs it and sends the output back; the share combines its
        assignments (weighted) and the ranks all-gather the shares."""
        group, k = self.group, self.top_k
        num_tokens, world = hidden.shape[0], group.world_size
        starts = share_bounds(num_tokens, world)
        lo, hi = starts[group.rank], starts[group.rank + 1]
        flat = experts[lo:hi].reshape(-1)  # [n * k] this share's assignments
        owner = self._owner(flat)  # [n * k] the rank holding each one's expert
        order = torch.argsort(owner, stable=True)  # grouped by destination rank
        send = torch.bincount(owner, minlength=world)
        receive = group.exchange_counts(send)
        send_l, receive_l = send.tolist(), receive.tolist()
        x_in = group.all_to_all(hidden[lo + order // k], send_l, receive_l)  # [m, H]
        e_in = group.all_to_all(flat[order], send_l, receive_l)  # [m] their experts
        y = group.all_to_all(self._run_local(x_in, e_in), receive_l, send_l)  # [n * k, H]
        y.mul_(weights[lo:hi].reshape(-1)[order].unsqueeze(1))
        share = hidden.new_zeros((hi - lo, hidden.shape[1])).index_add_(0, order // k, y)
        return group.all_gather_rows(share, [b - a for a, b in itertools.pairwise(starts)])

    def _owner(self, experts: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n] int64
        """The rank holding each expert (`expert_share`'s contiguous shares)."""
        world, e = self.group.world_size, self.num_experts
        bounds = torch.tensor([(r + 1) * e // world for r in range(world)], device=experts.device)
        return torch.bucketize(experts, bounds, right=True)

    def _run_local(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each received assignment [m, H] through its (local) expert, unweighted."""
        order = torch.argsort(experts, stable=True)
        local = self.local_experts
        counts = torch.bincount(experts - local.start, minlength=len(local)).tolist()
        y = torch.empty_like(x)
        start = 0
        for i, count in enumerate(counts):
            if count:
                rows = order[start : start + count]
                y[rows] = self._expert(i, x[rows])
                start += count
        return y

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        """Local expert i's MLP (this rank's slice of its intermediate features)."""
        b13 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[i]
        h = self.activation(F.linear(x, self.gate_up_proj[i], b13))  # [n, I / world]
        b2 = self.down_proj_bias[i] if self.down_proj_bias is not None else None
        once = self.group.rank == 0 or self.group.expert_parallel  # the bias on one rank
        return F.linear(h, self.down_proj[i], b2 if once else None)

    def load(self, name: str, tensor: torch.Tensor, part: int | None) -> None:
        """Copies this rank's slice of checkpoint tensor `name` (one of the parameter
        names) for its local experts: with `part`, one expert's gate (2e), up (2e + 1) or
        down (e) tensor; with None, all experts' stacked (see `ExpertsLayout`)."""
        e, i, h = self.num_experts, self.intermediate.full, self.hidden_size
        interleaved = self.layout is ExpertsLayout.STACKED_INTERLEAVED
        with torch.no_grad():
            if name == "gate_up_proj" and part is not None:
                check_shape(tensor, (i, h))
                expert, which = divmod(part, 2)
                halves = (tensor[None], None) if which == 0 else (None, tensor[None])
                self._set_gate_up(self.gate_up_proj, expert, *halves)
            elif name == "down_proj" and part is not None:
                check_shape(tensor, (h, i))
                self._set_down(self.down_proj, part, tensor[None])
            elif name == "gate_up_proj" and interleaved:
                check_shape(tensor, (e, h, 2 * i))
                gate, up = tensor[..., ::2].transpose(1, 2), tensor[..., 1::2].transpose(1, 2)
                self._set_gate_up(self.gate_up_proj, 0, gate, up)
            elif name == "gate_up_proj":
                check_shape(tensor, (e, 2 * i, h))
                self._set_gate_up(self.gate_up_proj, 0, tensor[:, :i], tensor[:, i:])
            elif name == "down_proj":
                check_shape(tensor, (e, i, h) if interleaved else (e, h, i))
                self._set_down(self.down_proj, 0, tensor.transpose(1, 2) if interleaved else tensor)
            elif name == "gate_up_proj_bias":
                check_shape(tensor, (e, 2 * i))
                gate, up = (tensor[:, ::2], tensor[:, 1::2]) if interleaved else tensor.chunk(2, 1)
                self._set_gate_up(self.gate_up_proj_bias, 0, gate, up)
            else:  # down_proj_bias: not sliced (added once, on the first rank)
                check_shape(tensor, (e, h))
                self._set_down(self.down_proj_bias, 0, tensor)

    def _local(self, first: int, count: int) -> tuple[slice, slice] | None:
        """(rows of ours, rows of the given) for the local experts among [first, first +
        count) of the checkpoint's, or None when there are none."""
        local = self.local_experts
        lo, hi = max(first, local.start), min(first + count, local.stop)
        if lo >= hi:
            return None
        return slice(lo - local.start, hi - local.start), slice(lo - first, hi - first)

    def _set_gate_up(self, param, first: int, gate, up) -> None:
        """gate, up: [experts, I, ...] from expert `first` on (either may be None)."""
        rows = self._local(first, (gate if gate is not None else up).shape[0])
        if rows is None:
            return
        ours, theirs = rows
        start, size = self.intermediate.start, self.intermediate.size
        for offset, half in ((0, gate), (size, up)):
            if half is not None:
                param[ours, offset : offset + size].copy_(half[theirs].narrow(1, start, size))

    def _set_down(self, param, first: int, down) -> None:
        """down: [experts, H, I] (sliced on I) or a bias [experts, H], from `first` on."""
        rows = self._local(first, down.shape[0])
        if rows is None:
            return
        ours, theirs = rows
        if down.dim() == 3:
            down = down.narrow(2, self.intermediate.start, self.intermediate.size)
        param[ours].copy_(down[theirs])
