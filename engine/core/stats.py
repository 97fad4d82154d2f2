"""Engine statistics: KV block usage, slot utilization, preemptions, prefix cache hits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class MemoryReport:
    """What the model and its KV cache take on the worker (from `WorkerReady`, once at
    start-up): weights (quantized ones in their blocks) and device KV cache in bytes,
    the cache's dtype and the weights' quantization."""

    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    kv_cache_dtype: str = ""
    quantization: str = ""

    @classmethod
    def from_ready(cls, ready) -> MemoryReport:  # a WorkerReady
        return cls(
            ready.weights_bytes, ready.kv_cache_bytes, ready.kv_cache_dtype, ready.quantization
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. `kv_slot_utilization` = token slots holding real tokens / slots
    allocated, now; `mean_kv_slot_utilization` is the same ratio summed over all steps.
    Prefix cache: prompt tokens looked up / found, cached blocks now, evictions so far."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    kv_slot_utilization: float
    mean_kv_slot_utilization: float
    num_preemptions: int
    num_steps: int
    num_running: int
    num_waiting: int
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_cached_blocks: int = 0
    num_cache_evictions: int = 0
    num_swaps: int = 0  # preemptions by swapping out (the rest recomputed)
    num_swapped_blocks: int = 0  # CPU swap blocks in use now
    # prompt tokens computed here (a recomputation after preemption counts again), and
    # those whose KV a prefill instance computed and this one loaded (P/D)
    num_prompt_tokens_computed: int = 0
    kv_transfer_loaded_tokens: int = 0
    kv_sharing_saving: float = 0.0  # now: 1 - blocks owned / blocks the tables hold
    mean_kv_sharing_saving: float = 0.0  # the same, summed over all steps
    attention_backend: str = ""  # the workers' attention backend ("native", "sdpa", ...)
    num_swapped: int = 0  # requests swapped out to CPU now (neither running nor waiting)
    weights_bytes: int = 0  # the model's weights on the worker(s): MemoryReport's
    kv_cache_bytes: int = 0
    kv_cache_dtype: str = ""
    quantization: str = ""
    # speculative decoding so far (vLLM's spec_decode metrics): steps in which a sequence
    # verified drafts, the drafts verified, those accepted, and accepted by draft position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def merged(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """One snapshot of several engines (data-parallel replicas): counts summed, each
        ratio averaged over the engines weighted by what it is a ratio of (blocks in use
        now, or steps run), backends listed once each."""
        values = {}
        for f in fields(cls):
            column = [getattr(p, f.name) for p in parts]
            if f.name in _RATIO_WEIGHTS:
                weights = [getattr(p, _RATIO_WEIGHTS[f.name]) for p in parts]
                total = sum(weights)
                weighted = sum(v * w for v, w in zip(column, weights, strict=True))
                values[f.name] = weighted / total if total else sum(column) / len(column)
            elif isinstance(column[0], str):
                values[f.name] = ",".join(dict.fromkeys(column))
            elif isinstance(column[0], tuple):  # per position: summed position by position
                values[f.name] = summed_by_position(column)
            else:
                values[f.name] = sum(column)
        return cls(**values)

    @property
    def kv_cache_usage(self) -> float:
        """Blocks in use / all blocks, in [0, 1] (vLLM's `kv_cache_usage_perc`)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Drafts accepted / drafts verified (0 when none were)."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens each speculating sequence gained per step: 1 + accepted / verifications."""
        n = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / n if n else 0.0


def summed_by_position(rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Element-wise sums of rows of counts; a shorter row counts 0 past its end."""
    width = max((len(r) for r in rows), default=0)
    return tuple(sum(r[i] for r in rows if i < len(r)) for i in range(width))


# EngineStats' ratios, and the count each is a ratio of (its weight when merged)
_RATIO_WEIGHTS = {
    "kv_slot_utilization": "num_used_blocks",
    "mean_kv_slot_utilization": "num_steps",
    "kv_sharing_saving": "num_used_blocks",
    "mean_kv_sharing_saving": "num_steps",
}


class SlotUtilization:
    """Accumulates (tokens stored, slots allocated) once per step; `last_tokens` is the
    latest step's tokens stored."""

    def __init__(self) -> None:
        self.tokens = 0
        self.slots = 0
        self.last = 1.0
        self.last_tokens = 0

    def record(self, tokens: int, slots: int) -> None:
        self.last_tokens = tokens
        if slots:
            self.tokens += tokens
            self.slots += slots
            self.last = tokens / slots

    @property
    def mean(self) -> float:
        return self.tokens / self.slots if self.slots else 1.0


@dataclass
class PrefixCacheStats:
    """Tokens of admitted requests looked up in the prefix cache, and how many were
    found there (so not computed)."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit


class SharingSaving:
    """Accumulates, once per step, the blocks the block tables hold (what they would
    need without sharing) and the blocks actually owned; the saving is the paper's
    blocks saved by sharing / blocks needed without sharing."""

    def __init__(self) -> None:
        self.table_blocks = 0
        self.owned_blocks = 0
        self.last = 0.0

    def record(self, table_blocks: int, owned_blocks: int) -> None:
        if table_blocks:
            self.table_blocks += table_blocks
            self.owned_blocks += owned_blocks
            self.last = 1.0 - owned_blocks / table_blocks

    @property
    def mean(self) -> float:
        return 1.0 - self.owned_blocks / self.table_blocks if self.table_blocks else 0.0


@dataclass
class SpecDecodeStats:
    """Speculative decoding so far: verifications (a sequence's drafts in one step),
    drafts verified, drafts accepted, and accepted drafts by position (index i: drafts
    accepted as the (i + 1)-th of their step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos += [0] * (num_drafts - len(per_pos))
        for i in range(num_accepted):
            per_pos[i] += 1

    def as_fields(self) -> dict:
        """EngineStats' spec_decode_* fields."""
        return dict(
            spec_decode_num_drafts=self.num_drafts,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.accepted_per_pos),
        )
