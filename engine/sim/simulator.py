"""`Simulator`: the real `EngineCore` (scheduler, block tables, plan builder, stop
checks) driven on a virtual clock by a model-free worker.

Each step is what the engine would run: arrivals up to the clock are added, the core
plans a step, a `SimWorker` applies the plan to its own request cache and "samples" a
fixed token for every sampling row (requests ignore EOS and stop at their trace's
output length; beams get synthetic offers to search over), and the clock advances by
the cost model's time for that step's shape.
When nothing can run, the clock jumps to the next arrival. Nothing here sleeps or reads
a wall clock, so a run is a pure function of its trace, configuration and cost model.

What it reports (`SimulationResult`): each request's arrival, first token and finish
times; per step, its start, duration, batch size, tokens and KV blocks in use (and the
scheduled request ids when `record_batches`, for comparing with the real engine).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field

from engine.config import PreemptionMode, SchedulerConfig
from engine.core.stats import EngineStats
from engine.kv.block_manager import block_tables_for
from engine.kv.block_tables import BlockTables
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv.kv_cache_manager import KVCacheManager
from engine.messages import AddRequest, StepPlan, StepResult, request_id_of, sequence_id
from engine.sampling_params import SamplingParams
from engine.sim.baselines.contiguous_kv_cache import ContiguousKVCacheManager
from engine.sim.baselines.reservation import ReservationPolicy
from engine.sim.baselines.static_partition_kv_cache import StaticPartitionKVCacheManager
from engine.sim.baselines.unshared_kv_cache import UnsharedKVCacheManager
from engine.sim.baselines.window_ignoring_kv_cache import WindowIgnoringKVCacheManager
from engine.sim.cost_model import CostModel, StepShape
from engine.sim.hybrid_presets import KVAllocator
from engine.sim.memory_shares import KVMemoryShares
from engine.sim.sim_worker import SimWorker
from engine.sim.trace import TraceRequest
from engine.wiring import build_core

SAMPLED_TOKEN = 7  # what the model-free worker "samples" (no request stops on it)


@dataclass(frozen=True)
class SimulatorConfig:
    """The engine being simulated: its scheduler budgets, KV cache (`num_blocks` of
    `block_size` tokens; `num_cpu_blocks` of swap space), prefix caching, preemption
    mode, pipeline depth (1: each result before the next plan, as the simulator's clock
    assumes; 2: one step ahead, as the server runs) and KV allocator: None for ours
    (paged), or a `ReservationPolicy` for the paper's Orca baselines (one contiguous
    region per request, placed by a buddy allocator; recompute preemption only).
    `layout`: the model's KV cache groups (None: one full-attention group); a hybrid
    one gets `kv_allocator`'s tables: the hybrid allocator's, each group on a fixed
    share of the pages (static), or every layer keeping every token (no-window)."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = False
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    num_cpu_blocks: int = 0
    pipeline_depth: int = 1
    allocator: ReservationPolicy | None = None
    share_blocks: bool = True  # paged only: False copies what forks share (an ablation)
    layout: KVCacheLayout | None = None
    kv_allocator: KVAllocator = KVAllocator.HYBRID
    # a decode instance of prefill/decode disaggregation: every prompt's KV arrives
    # computed (transferred), so prompt tokens cost nothing to compute here
    prompts_arrive_computed: bool = False

    def build_blocks(self) -> BlockTables:
        options = dict(
            enable_prefix_caching=self.enable_prefix_caching, num_cpu_blocks=self.num_cpu_blocks
        )
        if self.layout is not None and self.layout.is_hybrid:
            tables = {
                KVAllocator.HYBRID: block_tables_for,
                KVAllocator.STATIC: StaticPartitionKVCacheManager,
                KVAllocator.NO_WINDOW: WindowIgnoringKVCacheManager,
            }[self.kv_allocator]
            return tables(self.num_blocks, self.block_size, layout=self.layout, **options)
        if self.allocator is None:
            paged = KVCacheManager if self.share_blocks else UnsharedKVCacheManager
            return paged(
                self.num_blocks,
                self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_cpu_blocks=self.num_cpu_blocks,
            )
        return ContiguousKVCacheManager(
            self.num_blocks,
            self.block_size,
            self.allocator,
            self.scheduler.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            num_cpu_blocks=self.num_cpu_blocks,
        )


@dataclass
class RequestTimes:
    """One request on the virtual clock (seconds): arrival, first output token, finish
    (None until then), and its trace lengths."""

    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def normalized_latency_s(self) -> float:
        """End-to-end latency per output token (the paper's Fig. 12 metric)."""
        return self.latency_s / self.output_len


@dataclass(frozen=True)
class StepRecord:
    """One simulated step: when it started, how long it took, how many requests and
    tokens it computed, the KV blocks in use after planning it, the scheduler's
    preemptions so far, and (when recorded) the scheduled request ids in plan order."""

    start_s: float
    duration_s: float
    batch_size: int
    num_tokens: int
    num_used_blocks: int
    num_preemptions: int
    request_ids: tuple[str, ...] = ()


@dataclass
class SimulationResult:
    """What a run produced (see the module doc); `stats`: the engine core's at the end
    (preemptions, swaps, prefix-cache hits, mean KV slot utilization)."""

    requests: dict[str, RequestTimes]
    steps: list[StepRecord] = field(default_factory=list)
    stats: EngineStats | None = None
    end_s: float = 0.0
    memory_sums: list[int] = field(default_factory=lambda: [0] * 5)  # KVMemoryShares fields

    def mean_memory_shares(self) -> dict[str, float]:
        """Each share of the KV cache's slots (token, reserved, internal, external,
        free), averaged over the steps."""
        summed = KVMemoryShares(*self.memory_sums)
        return summed.fractions() if summed.total else {}

    def used_by_tokens(self) -> float:
        """The share of allocated KV slots holding tokens, over the run (the paper's
        "memory usage" of Fig. 2: 20.4-38.2% for the prior systems)."""
        return KVMemoryShares(*self.memory_sums).used_by_tokens

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions if self.stats else 0

    @property
    def finished(self) -> list[RequestTimes]:
        return [r for r in self.requests.values() if r.finish_s is not None]

    def mean_normalized_latency(self) -> float:
        done = self.finished
        return sum(r.normalized_latency_s for r in done) / len(done) if done else float("inf")

    def mean_batch_size(self) -> float:
        return sum(s.batch_size for s in self.steps) / len(self.steps) if self.steps else 0.0

    def mean_ttft(self) -> float:
        """Mean time from arrival to the first output token."""
        done = self.finished
        return sum(r.first_token_s - r.arrival_s for r in done) / len(done) if done else 0.0


class Simulator:
    """Runs traces through the real engine core (see the module doc). One simulator
    runs one trace (`run`); make another for the next."""

    def __init__(
        self, config: SimulatorConfig, cost: CostModel, record_batches: bool = False
    ) -> None:
        if config.pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline_depth must be 1 or 2, got {config.pipeline_depth}")
        self.config, self.cost, self.record_batches = config, cost, record_batches
        self.blocks = config.build_blocks()
        self.core = build_core(config.scheduler, self.blocks, frozenset(), config.preemption_mode)
        self.worker = SimWorker(token_id=SAMPLED_TOKEN)
        self.clock = 0.0

    def run(self, trace: Sequence[TraceRequest]) -> SimulationResult:
        """Simulates `trace` (sorted by arrival) until every request has finished."""
        pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        times = {r.request_id: RequestTimes(r.arrival_s, r.prompt_len, r.output_len) for r in trace}
        result = SimulationResult(times)
        in_flight: deque[tuple[StepResult, float]] = deque()
        while pending or self.core.has_unfinished or in_flight:
            self._admit(pending)
            while len(in_flight) < self.config.pipeline_depth:
                plan = self.core.plan()
                if plan is None:
                    break
                in_flight.append(self._execute(plan, result))
            if not in_flight:
                if not pending:
                    raise RuntimeError(f"no step can run: {self.core.stats()}")
                self.clock = max(self.clock, pending[0].arrival_s)
                continue
            step_result, done_s = in_flight.popleft()
            self._deliver(step_result, done_s, times)
        result.stats = self.core.stats()
        result.end_s = self.clock
        return result

    def _admit(self, pending: deque[TraceRequest]) -> None:
        while pending and pending[0].arrival_s <= self.clock:
            request = pending.popleft()
            if isinstance(self.blocks, ContiguousKVCacheManager):  # reserves for the truth
                for seq_id in _sequence_ids(request):
                    self.blocks.expect(seq_id, request.prompt_len, request.output_len)
            self.core.add_request(_add_request(request))

    def _execute(self, plan: StepPlan, result: SimulationResult) -> tuple[StepResult, float]:
        """Runs `plan` on the model-free worker; the clock moves by the step's cost (a
        plan that computes nothing, only telling the worker what ended, costs nothing
        and is not a step)."""
        if not plan.scheduled_ids:
            return self.worker.execute(plan), self.clock
        requests, blocks = self.core.scheduler.requests, self.core.blocks
        # KV tokens read, averaged over the layers (a sliding window reads at most W)
        needed = blocks.needed_slots
        contexts = sum(needed(requests[r].num_computed_tokens) for r in plan.scheduled_ids)
        contexts //= blocks.num_groups
        swapped = (len(plan.swap_out_src) + len(plan.swap_in_src)) * self.config.block_size
        shape = StepShape(self._computed_tokens(plan), contexts, swapped)
        duration = self.cost.step_seconds(shape)
        result.steps.append(
            StepRecord(
                self.clock,
                duration,
                len(plan.scheduled_ids),
                shape.num_tokens,
                self.core.blocks.num_blocks - self.core.blocks.num_free_blocks,
                self.core.scheduler.num_preemptions,
                plan.scheduled_ids if self.record_batches else (),
            )
        )
        for i, value in enumerate(astuple(self._memory_shares())):
            result.memory_sums[i] += value
        self.clock += duration
        return self.worker.execute(plan), self.clock

    def _computed_tokens(self, plan: StepPlan) -> int:
        """The tokens the step computes: all scheduled ones, or, where prompts arrive
        computed, those past each prompt (the plan has advanced the counts already)."""
        if not self.config.prompts_arrive_computed:
            return sum(plan.num_scheduled_tokens)
        requests, total = self.core.scheduler.requests, 0
        for request_id, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
            request = requests[request_id]
            end = request.num_computed_tokens
            total += end - max(end - n, min(end, len(request.prompt_token_ids)))
        return total

    def _memory_shares(self) -> KVMemoryShares:
        """Where the KV slots are after planning this step. Paged: the running requests'
        computed tokens (less than a block per table is slack, counted as
        the allocator's rounding, external; nothing is reserved ahead)."""
        if isinstance(self.blocks, ContiguousKVCacheManager):
            return self.blocks.memory_shares()
        size = self.config.block_size
        used = self.blocks.num_used_blocks * size
        token = min(self.core.utilization.last_tokens, used)  # this step's, as recorded
        return KVMemoryShares(token, 0, 0, used - token, self.blocks.num_blocks * size - used)

    def _deliver(self, step: StepResult, done_s: float, times: dict[str, RequestTimes]) -> None:
        deltas = self.core.on_result(step)
        for request_id in deltas.request_ids:
            entry = times[request_id_of(request_id)]
            if entry.first_token_s is None:
                entry.first_token_s = done_s
        for finish in deltas.finished:
            times[request_id_of(finish.request_id)].finish_s = done_s
        for ranked in deltas.ranked:  # a beam search returns its beams when it ends
            entry = times[ranked.request_id]
            entry.first_token_s = entry.finish_s = done_s


def _sequence_ids(request: TraceRequest) -> list[str]:
    """The scheduler's ids for a trace request's sequences (a beam search's first beam;
    the others are forked from it)."""
    if request.use_beam_search:
        return [sequence_id(request.request_id, 0)]
    if request.n == 1:
        return [request.request_id]
    return [sequence_id(request.request_id, i) for i in range(request.n)]


def _add_request(request: TraceRequest) -> AddRequest:
    beam, n = request.use_beam_search, request.n
    temperature = 1.0 if n > 1 and not beam else 0.0  # n > 1 samples (the tokens are fixed)
    params = SamplingParams(
        n=n,
        max_tokens=request.output_len,
        ignore_eos=True,
        temperature=temperature,
        use_beam_search=beam,
    )
    return AddRequest(request.request_id, request.token_ids(), params, request.arrival_s)
