"""Expert parallelism's all-to-all against tensor parallelism's all-reduce, in simulation:
what each costs a decode step's MoE layers over E ranks joined by one link.

Tensor-parallel MoE: every rank holds every token of the step and a 1/E slice of every
expert; a ring all-reduce of the tokens' hidden states sums the slices, so
2 (E - 1) / E x tokens x hidden x bytes leave each rank over 2 (E - 1) latencies.
Every rank computes 1/E of every routed token's expert work, reading 1/E of each expert
the step reaches: balanced.

Expert-parallel MoE with data-parallel attention (DeepSeek-V3's serving, vLLM's EP with
DP): each rank owns tokens / E of the step and N / E whole experts, placed contiguously
as `engine/worker/models/fused_moe.py` places them. Dispatch sends each token's hidden
state to the ranks of its top_k experts, combine brings the outputs back: two
all-to-alls of tokens x top_k x hidden x bytes, of which (E - 1) / E leave each rank,
each all-to-all paying E - 1 latencies (pairwise exchange). The rank holding the
router's favourites receives (and returns) the most, so both take as long as the
busiest rank's routed tokens, the max over ranks and not the mean tokens x top_k / E;
that rank also sets the compute time (the others wait for it): its GEMMs read the
experts its load reaches (spread evenly over its N / E) and compute its tokens.

With equal latencies (two all-to-alls pay 2 (E - 1), as the ring does) the
communication crossover depends on top_k, E and the routing only, not on the link: EP
moves fewer bytes once the busiest rank's load is under the step's tokens, about
top_k x imbalance < E. Small steps route lumpily (a few tokens land where they land),
so the imbalance falls as steps grow and EP wins from some step size on.

The busiest rank's load for a step of T tokens, from each rank's share q of the
(token, expert) assignments (given per-expert loads, uniform, or Zipf): a token gives a
rank at most c = min(top_k, N / E) of them (its k experts are distinct), so each rank's
count is taken as Binomial(T c, top_k q / c), independent of the others, and the busiest
rank's load is the expected maximum of those counts, summed exactly from their
distributions (past 500 expected per rank: each rank's mean plus z_E standard deviations,
z_E the expected maximum of E standard normals by Blom's approximation), and at least
ceil(T top_k / E).

Not modelled: overlapping communication with compute (DeepSeek's two micro-batches),
node-limited routing, shared experts (the same under both), attention's collectives.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from engine.kv.block_count import cdiv
from engine.sim.disaggregation import TransferLink
from engine.sim.pipeline import Accelerator, ring_allreduce_seconds


@dataclass(frozen=True)
class MoeShape:
    """A mixture of experts' MoE layers: `num_experts` routed experts of
    `intermediate_size` (gate, up and down: 3 x hidden x intermediate weights each, of
    `weight_bytes`), `top_k` per token, in `num_moe_layers` layers; hidden states cross
    the wire at `activation_bytes` per element."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_moe_layers: int
    activation_bytes: float = 2
    weight_bytes: float = 2

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")

    @property
    def expert_bytes(self) -> float:
        return 3 * self.hidden_size * self.intermediate_size * self.weight_bytes

    @property
    def flops_per_assignment(self) -> float:
        """One token through one expert: 2 FLOPs per weight."""
        return 2 * 3 * self.hidden_size * self.intermediate_size


MIXTRAL_8X7B = MoeShape("Mixtral-8x7B-like", 4096, 14336, 8, 2, 32)
# fp8 experts, bfloat16 hidden states on the wire (DeepEP dispatches fp8: half these bytes)
DEEPSEEK_V3 = MoeShape("DeepSeek-V3-like", 7168, 2048, 256, 8, 58, weight_bytes=1)


@dataclass(frozen=True)
class Routing:
    """How the router spreads (token, expert) assignments: each expert's share, in
    expert order, summing to 1."""

    shares: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.shares or min(self.shares) < 0 or not math.isclose(sum(self.shares), 1):
            raise ValueError("shares must be non-negative, one per expert, summing to 1")

    @classmethod
    def uniform(cls, num_experts: int) -> Routing:
        return cls((1 / num_experts,) * num_experts)

    @classmethod
    def zipf(cls, num_experts: int, exponent: float, seed: int = 0) -> Routing:
        """Popularity rank r weighs 1 / r^exponent; the ranks are dealt to the experts in
        a seeded order (a trained router's favourites sit anywhere)."""
        weights = [1 / r**exponent for r in range(1, num_experts + 1)]
        random.Random(seed).shuffle(weights)
        return cls.from_loads(weights)

    @classmethod
    def from_loads(cls, loads: Sequence[float]) -> Routing:
        """Measured per-expert loads (one layer of `LLM.expert_load()`), normalized."""
        total = sum(loads)
        if not total > 0:
            raise ValueError("the loads sum to 0: no token was routed")
        return cls(tuple(x / total for x in loads))

    @property
    def num_experts(self) -> int:
        return len(self.shares)

    def rank_shares(self, ranks: int) -> tuple[float, ...]:
        """Each rank's share, its N / E experts placed contiguously."""
        per_rank = _experts_per_rank(self.num_experts, ranks)
        return tuple(sum(self.shares[r * per_rank : (r + 1) * per_rank]) for r in range(ranks))

    def max_rank_load(self, num_tokens: int, top_k: int, ranks: int) -> float:
        """The busiest rank's expected assignments for a step of `num_tokens` tokens (the
        module doc's approximation)."""
        most = min(top_k, _experts_per_rank(self.num_experts, ranks))
        probs = [min(1.0, top_k * q / most) for q in self.rank_shares(ranks)]
        busiest = _expected_max(num_tokens * most, probs)
        return max(busiest, cdiv(num_tokens * top_k, ranks))

    def experts_hit(self, num_tokens: int, top_k: int) -> float:
        """The step's expected experts routed at least one of `num_tokens` tokens (a
        token picks expert i with probability about top_k x its share)."""
        return sum(1 - (1 - min(1.0, top_k * p)) ** num_tokens for p in self.shares)


@dataclass(frozen=True)
class MoeLayout:
    """E = `ranks` GPUs (`device` each, at `efficiency` of its peaks, the cost model's
    default) joined by `link`; the slowest link between two ranks stands for all."""

    ranks: int
    link: TransferLink
    device: Accelerator
    efficiency: float = 0.8

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")


@dataclass(frozen=True)
class MoeStepCost:
    """One step's MoE time over all MoE layers (s): collectives, then expert GEMMs."""

    comm_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s


def all_to_all_seconds(link: TransferLink, ranks: int, nbytes: float) -> float:
    """An all-to-all in which a rank exchanges `nbytes`, 1 / ranks with each rank
    (itself included): ranks - 1 pairwise rounds, each a latency and a share, so
    (ranks - 1) / ranks x nbytes leave the rank."""
    return (ranks - 1) * (link.latency_s + nbytes / ranks / link.bandwidth)


def dispatch_bytes(shape: MoeShape, routing: Routing, num_tokens: int, ranks: int) -> float:
    """What the busiest rank exchanges in one all-to-all (dispatch or combine) of a
    step of `num_tokens` tokens: its routed tokens' hidden states."""
    load = routing.max_rank_load(num_tokens, shape.top_k, ranks)
    return load * shape.hidden_size * shape.activation_bytes


def ep_step(shape: MoeShape, layout: MoeLayout, routing: Routing, num_tokens: int) -> MoeStepCost:
    """A step of `num_tokens` tokens through the MoE layers with expert parallelism."""
    ranks = layout.ranks
    nbytes = dispatch_bytes(shape, routing, num_tokens, ranks)
    comm = 2 * all_to_all_seconds(layout.link, ranks, nbytes)  # dispatch, then combine
    load = routing.max_rank_load(num_tokens, shape.top_k, ranks)
    per_rank = shape.num_experts // ranks  # the busiest rank's experts that its load reaches
    experts = per_rank * (1 - (1 - 1 / per_rank) ** load)
    compute = _gemm_seconds(shape, layout, experts * shape.expert_bytes, load)
    return MoeStepCost(comm * shape.num_moe_layers, compute * shape.num_moe_layers)


def tp_step(shape: MoeShape, layout: MoeLayout, routing: Routing, num_tokens: int) -> MoeStepCost:
    """A step of `num_tokens` tokens through the MoE layers with tensor parallelism."""
    ranks = layout.ranks
    nbytes = num_tokens * shape.hidden_size * shape.activation_bytes  # [num_tokens, hidden]
    comm = ring_allreduce_seconds(layout.link, ranks, nbytes)
    experts = routing.experts_hit(num_tokens, shape.top_k)
    load = num_tokens * shape.top_k / ranks
    compute = _gemm_seconds(shape, layout, experts * shape.expert_bytes / ranks, load)
    return MoeStepCost(comm * shape.num_moe_layers, compute * shape.num_moe_layers)


def ep_winning_range(
    shape: MoeShape,
    layout: MoeLayout,
    routing: Routing,
    with_compute: bool = False,
    max_tokens: int = 1 << 16,
) -> tuple[int, int] | None:
    """The first and last step sizes (tokens, 1 to `max_tokens`) at which EP's
    communication (`with_compute`: its whole MoE time) beats TP's, each found by
    bisection between the powers of two where the winner changes; None where EP never
    wins. One winning range is assumed: communication alone wins from a point on (the
    busiest rank's share of the tokens only falls as steps grow), while EP's compute
    imbalance can take the win back at large steps."""

    def ep_wins(tokens: int) -> bool:
        ep, tp = ep_step(shape, layout, routing, tokens), tp_step(shape, layout, routing, tokens)
        return ep.total_s < tp.total_s if with_compute else ep.comm_s < tp.comm_s

    grid = [1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens] + [max_tokens]
    wins = [i for i, tokens in enumerate(grid) if ep_wins(tokens)]
    if not wins:
        return None
    first, last = wins[0], wins[-1]
    start = grid[0] if first == 0 else _flip(grid[first - 1], grid[first], ep_wins)
    end = grid[-1] if last == len(grid) - 1 else _flip(grid[last], grid[last + 1], ep_wins) - 1
    return start, end


def crossover_tokens(
    shape: MoeShape, layout: MoeLayout, routing: Routing, max_tokens: int = 1 << 16
) -> int | None:
    """The smallest step (tokens) from which EP's dispatch and combine move less than
    TP's all-reduce; None where they never do (top_k >= E, or routing too skewed)."""
    found = ep_winning_range(shape, layout, routing, max_tokens=max_tokens)
    return found[0] if found else None


def _flip(low: int, high: int, test: Callable[[int], bool]) -> int:
    """The smallest t in (low, high] with test(t) == test(high), where test(low) differs."""
    outcome = test(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if test(mid) == outcome else (mid, high)
    return high


def _gemm_seconds(shape: MoeShape, layout: MoeLayout, weight_bytes: float, load: float) -> float:
    """One MoE layer's expert GEMMs on a rank: reading `weight_bytes` of experts or
    computing `load` assignments, whichever takes longer."""
    device, efficiency = layout.device, layout.efficiency
    memory_s = weight_bytes / (device.memory_bandwidth * efficiency)
    compute_s = load * shape.flops_per_assignment / (device.peak_flops * efficiency)
    return max(memory_s, compute_s)


def _expected_max(trials: int, probs: Sequence[float]) -> float:
    """E[max] of independent Binomial(trials, p) counts, one per p: the sum over m of
    P(max > m) = 1 - prod F_p(m); the normal approximation past 500 expected."""
    if trials * max(probs) > 500:
        z = NormalDist().inv_cdf((len(probs) - 0.375) / (len(probs) + 0.25))
        return max(trials * p + z * math.sqrt(trials * p * (1 - p)) for p in probs)
    counts = Counter(probs)
    pmfs = {p: (1 - p) ** trials for p in counts}  # P(count = m), from m = 0
    cdfs = dict(pmfs)
    total = 0.0
    for m in range(trials):
        tail = 1 - math.prod(cdfs[p] ** n for p, n in counts.items())  # P(max > m)
        if tail < 1e-12:
            break
        total += tail
        for p in counts:
            if p < 1:
                pmfs[p] *= (trials - m) / (m + 1) * p / (1 - p)
                cdfs[p] += pmfs[p]
    return total


def _experts_per_rank(num_experts: int, ranks: int) -> int:
    if ranks < 1 or num_experts % ranks:
        raise ValueError(
            f"{num_experts} experts do not split over {ranks} ranks; use a rank count "
            f"that divides {num_experts}"
        )
    return num_experts // ranks
