"""Pipeline parallelism in simulation: S stages of a model, M micro-batches in flight.

A stage holds a share of the layers (an even 1/S, or given layer counts) on its own
GPUs. A step's time from the `CostModel` (the whole model on one stage's GPUs) splits
over the stages by that share, overhead included (each stage launches its own layers'
kernels). Between stages a micro-batch's hidden states cross a `TransferLink`, one hop
per boundary: latency + tokens x hidden_size x activation bytes / bandwidth.

Forward only (a prefill batch; GPipe's schedule without the backward): M micro-batches
enter stage 0 one period apart, the period being the slowest stage or hop, so

    makespan = sum(stage_s) + (S - 1) x hop_s + (M - 1) x period_s
             = (M + S - 1) x stage_s + (S - 1) x hop_s     (even stages, hop <= stage)
    bubble   = (S - 1) / (M + S - 1)                        (the idle share, hops free)

Decode with M micro-batches kept in flight (vLLM's virtual engines: one scheduler
output per micro-batch, a micro-batch's next token planned when its last returns): a
token takes latency = sum(stage_s) + S hops (S - 1 carrying hidden states, one
returning the sampled ids: its latency only), and a stage serves one micro-batch per
period, so each micro-batch makes a token every

    cycle = max(latency, M x period)      TPOT = cycle, tokens/s = batch / cycle

With free hops no stage idles once M >= S; with fewer, (S - M) / S of the stage time
is idle. Each micro-batch reads its stage's weights again, which the cost model
charges: in memory-bound decode, micro-batches beyond S only add weight reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_count import cdiv
from engine.sim.cost_model import A100_80_BANDWIDTH, A100_FP16_FLOPS, CostModel, StepShape
from engine.sim.disaggregation import TransferLink

FREE_LINK = TransferLink(bandwidth=float("inf"))  # no latency, no bandwidth limit
GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """One GPU: its memory (bytes), HBM bandwidth (bytes/s) and dense 16-bit tensor-core
    peak (FLOP/s), all at the data sheet's figures (the cost model's `efficiency`
    takes the achieved share)."""

    name: str
    memory_bytes: float
    memory_bandwidth: float
    peak_flops: float


A100_80GB = Accelerator("A100-SXM-80GB", 80 * GIB, A100_80_BANDWIDTH, A100_FP16_FLOPS)
H100_80GB = Accelerator("H100-SXM-80GB", 80 * GIB, 3.35e12, 989e12)


@dataclass(frozen=True)
class DenseShape:
    """A dense decoder's figures the cost model needs: parameters, layers, hidden size,
    the KV bytes one token keeps (K and V, all layers), and the bytes per weight and
    per activation element on the wire (`dtype_bytes`)."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    kv_bytes_per_token: float
    dtype_bytes: float = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes


def _llama(name: str, params: float, layers: int, hidden: int) -> DenseShape:
    return DenseShape(name, params, layers, hidden, kv_bytes_per_token=2 * layers * 8 * 128 * 2)


# bfloat16, 8 KV heads of 128 (grouped-query attention): 320 KB and 504 KB of KV a token
LLAMA_70B = _llama("Llama-3-70B-like", 70.6e9, 80, 8192)
LLAMA_405B = _llama("Llama-3.1-405B-like", 405.9e9, 126, 16384)


def ring_allreduce_seconds(link: TransferLink, ranks: int, nbytes: float) -> float:
    """A ring all-reduce of `nbytes` held by each of `ranks` ranks: 2 (ranks - 1) steps,
    each paying the link's latency and sending a 1/ranks share, so
    2 (ranks - 1) / ranks x nbytes leave each rank (the slowest link of the ring sets
    both figures)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return 2 * (ranks - 1) * (link.latency_s + nbytes / ranks / link.bandwidth)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle share of the stages' time for one pass of `micro_batches` through
    `stages` even stages with free hops: (S - 1) / (M + S - 1)."""
    _check_counts(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def decode_idle_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of the stages' time in steady-state decode with `micro_batches`
    kept in flight (even stages, free hops): (S - M) / S below S, none from S on."""
    _check_counts(stages, micro_batches)
    return max(0.0, (stages - micro_batches) / stages)


@dataclass(frozen=True)
class Schedule:
    """One forward pass of a step's micro-batches: its makespan (s) and the idle share
    of the stages' time over it."""

    makespan_s: float
    bubble: float


@dataclass(frozen=True)
class DecodeRate:
    """Steady-state decode: seconds per output token of each sequence, output tokens
    per second of the whole batch, and the busy share of the stages' time."""

    tpot_s: float
    tokens_per_s: float
    busy: float


@dataclass(frozen=True)
class Pipeline:
    """`cost` (the whole model on one stage's GPUs) split over `stages` by layer share
    (`layers`: each stage's layer count, summing to the model's; empty: 1/S each),
    stages joined by `link`, hidden states crossing it at `activation_bytes` per
    element. Pure: the formulas are the module doc's."""

    cost: CostModel
    stages: int
    link: TransferLink = FREE_LINK
    activation_bytes: float = 2
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_counts(self.stages, 1)
        if not self.layers:
            return
        if len(self.layers) != self.stages or min(self.layers) < 1:
            raise ValueError(f"layers needs {self.stages} counts >= 1, got {self.layers}")
        if sum(self.layers) != self.cost.num_layers:
            raise ValueError(
                f"layers {self.layers} sum to {sum(self.layers)}; "
                f"{self.cost.name} has {self.cost.num_layers}"
            )

    @property
    def shares(self) -> tuple[float, ...]:
        """Each stage's share of the layers."""
        if not self.layers:
            return (1 / self.stages,) * self.stages
        return tuple(n / self.cost.num_layers for n in self.layers)

    def stage_seconds(self, micro: StepShape) -> tuple[float, ...]:
        """Each stage's time for one micro-batch of shape `micro`."""
        step_s = self.cost.step_seconds(micro)
        return tuple(step_s * share for share in self.shares)

    def hop_seconds(self, num_tokens: int) -> float:
        """A micro-batch's hidden states, [num_tokens, hidden_size], crossing one
        stage boundary (0 with one stage)."""
        if self.stages == 1:
            return 0.0
        return self.link.seconds(num_tokens, self.cost.hidden_size * self.activation_bytes)

    def schedule(self, step: StepShape, micro_batches: int) -> Schedule:
        """`step` cut into `micro_batches` passing through the stages once."""
        micro = micro_batch(step, micro_batches)
        stages, hop = self.stage_seconds(micro), self.hop_seconds(micro.num_tokens)
        period = max(*stages, hop)
        makespan = sum(stages) + (self.stages - 1) * hop + (micro_batches - 1) * period
        busy = micro_batches * sum(stages) / (self.stages * makespan)
        return Schedule(makespan, 1 - busy)

    def decode(self, step: StepShape, micro_batches: int) -> DecodeRate:
        """Steady-state decode of `step` (one token per sequence) as `micro_batches`
        kept in flight."""
        micro = micro_batch(step, micro_batches)
        stages, hop = self.stage_seconds(micro), self.hop_seconds(micro.num_tokens)
        returned = self.link.latency_s if self.stages > 1 else 0.0  # the sampled ids
        latency = sum(stages) + (self.stages - 1) * hop + returned
        cycle = max(latency, micro_batches * max(*stages, hop))
        busy = micro_batches * sum(stages) / (self.stages * cycle)
        return DecodeRate(cycle, step.num_tokens / cycle, busy)


def micro_batch(step: StepShape, micro_batches: int) -> StepShape:
    """The largest of `micro_batches` even parts of `step` (it sets the pace)."""
    _check_counts(1, micro_batches)
    if micro_batches > step.num_tokens:
        raise ValueError(
            f"{micro_batches} micro-batches for a step of {step.num_tokens} tokens: each "
            "micro-batch needs a token; use at most as many micro-batches as tokens"
        )
    return StepShape(
        cdiv(step.num_tokens, micro_batches),
        cdiv(step.num_context_tokens, micro_batches),
        cdiv(step.num_swapped_tokens, micro_batches),
    )


@dataclass(frozen=True)
class ParallelLayout:
    """`pp` pipeline stages of `tp` GPUs each: tensor parallelism inside a stage (two
    ring all-reduces of the micro-batch's hidden states per layer over `tp_link`),
    stages joined by `pp_link`, `micro_batches` in flight (vLLM keeps one per stage)."""

    tp: int
    pp: int = 1
    micro_batches: int = 1
    tp_link: TransferLink = FREE_LINK
    pp_link: TransferLink = FREE_LINK

    def __post_init__(self) -> None:
        _check_counts(self.tp, self.micro_batches)
        _check_counts(self.pp, 1)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP={self.tp} x PP={self.pp}, {self.micro_batches} micro-batches"


def kv_slots(
    shape: DenseShape, device: Accelerator, layout: ParallelLayout, utilization: float = 0.9
) -> int:
    """The KV tokens `layout`'s GPUs hold beside the weights, at `utilization` of their
    memory (vLLM's default 0.9); 0 when the weights alone do not fit."""
    free = layout.num_gpus * device.memory_bytes * utilization - shape.weight_bytes
    return max(0, int(free // shape.kv_bytes_per_token))


def stage_cost(
    shape: DenseShape,
    device: Accelerator,
    layout: ParallelLayout,
    num_tokens: int,
    overhead_s: float = 0.002,
    efficiency: float = 0.8,
) -> CostModel:
    """The whole model on one stage's `tp` GPUs (what `Pipeline` splits by layer):
    their bandwidth and FLOP/s, an all-reduce sized for `num_tokens` hidden states,
    the KV slots the whole layout holds; overhead and efficiency are the cost model's
    defaults (guesses, as there)."""
    nbytes = num_tokens * shape.hidden_size * shape.dtype_bytes
    return CostModel(
        name=f"{shape.name}, {layout} on {device.name}",
        num_params=shape.num_params,
        weight_bytes=shape.weight_bytes,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_gpus=layout.tp,
        memory_bandwidth=device.memory_bandwidth * layout.tp,
        peak_flops=device.peak_flops * layout.tp,
        num_kv_slots=max(1, kv_slots(shape, device, layout)),
        overhead_s=overhead_s,
        efficiency=efficiency,
        allreduce_s_per_layer=ring_allreduce_seconds(layout.tp_link, layout.tp, nbytes),
    )


def decode_rate(
    shape: DenseShape, device: Accelerator, layout: ParallelLayout, batch: int, context_len: int
) -> DecodeRate:
    """Steady-state decode of `batch` sequences of `context_len` tokens on `layout`
    (memory aside: `kv_slots` says whether it fits). `ParallelLayout(1)` is one device."""
    step = StepShape(batch, batch * context_len)
    micro = micro_batch(step, layout.micro_batches)
    cost = stage_cost(shape, device, layout, micro.num_tokens)
    pipeline = Pipeline(cost, layout.pp, layout.pp_link, shape.dtype_bytes)
    return pipeline.decode(step, layout.micro_batches)


def _check_counts(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ValueError(
            f"stage, rank and micro-batch counts must be >= 1, got {stages} and {micro_batches}"
        )
