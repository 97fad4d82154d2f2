"""Prometheus metrics of one server (its own registry: no process-wide globals).

Two vocabularies over the same observations: our `pagedserve_*` names, and the `vllm:*`
names a stock vLLM Grafana dashboard queries (each with a `model_name` label, the served
model name, which the dashboard's model selector filters on). Names, types, label names
and histogram buckets of the `vllm:*` metrics follow vLLM v1's PrometheusStatLogger.
Engine numbers are read at scrape time, one `EngineStats` snapshot per scrape
(`EngineCollector`); what the web layer sees (tokens, latencies, request ends, error
answers) is recorded as it happens through `Metrics`' methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from actors.async_engine import WatchStats
from actors.engine_status import EngineStatus
from engine.core.stats import EngineStats
from engine.messages import ErrorKind, OutputDelta

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
VLLM_TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
VLLM_ITL_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
VLLM_E2E_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class FinishReason(StrEnum):
    """How one sequence of a request ended. vLLM's `finished_reason` label has stop,
    length and abort; a request past --request-timeout is an abort there (`vllm`) and
    `timeout` in our own counter; `error` is an engine failure."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"

    @classmethod
    def of(cls, out: OutputDelta) -> FinishReason:
        """The reason of a final delta (`finish_reason` set)."""
        if out.finish_reason == "error":
            return cls.TIMEOUT if out.error_kind is ErrorKind.TIMEOUT else cls.ERROR
        return cls(out.finish_reason)

    @property
    def vllm(self) -> str:
        return "abort" if self is FinishReason.TIMEOUT else self.value


class Metrics:
    """Counters and histograms the web layer records, plus the engine's and the web
    layer's gauges and counters read at scrape time. `render()` is the /metrics body.

    Recording API (one call per event): `first_token`, `generated`, `finished` (once per
    sequence: every sequence of every request ends exactly once, stop, length, abort,
    timeout or error) and `refused` (once per error answer: an HTTP error body, an SSE
    error event or a WebSocket `error` event, by its code)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        watch: Callable[[], WatchStats],
        web_gauges: dict[str, tuple[str, Callable[[], float]]],
        model_name: str,
        max_model_len: int,
        statuses: Callable[[], Sequence[EngineStatus]] = lambda: (),
        replica_stats: Callable[[], Sequence[EngineStats]] = lambda: (),
    ) -> None:
        """`web_gauges`: name -> (help, read) for the web layer's own counts (queued
        requests, live requests, sessions, WebSocket connections); `statuses`: each
        data-parallel replica's status and stats (one for a single engine)."""
        self.registry = r = CollectorRegistry()
        self.num_prompt_tokens = 0  # totals, for the periodic stats line
        self.num_generation_tokens = 0
        self._ours = _OurMetrics(r)
        self._vllm = _VllmMetrics(r, model_name, max_model_len)
        r.register(EngineCollector(stats, watch, model_name))
        r.register(ReplicaCollector(statuses, replica_stats))
        for name, (doc, read) in web_gauges.items():
            Gauge(name, doc, registry=r).set_function(read)

    def first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        """A request's first token, `ttft_s` after it arrived; its prompt is counted."""
        self.num_prompt_tokens += num_prompt_tokens
        for m in (self._ours, self._vllm):
            m.ttft.observe(ttft_s)
            m.prompt_tokens.inc(num_prompt_tokens)

    def generated(self, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` new tokens; `gap_s`: seconds since the request's previous tokens
        (None for its first), spread evenly over them (one observation per token)."""
        self.num_generation_tokens += num_tokens
        for m in (self._ours, self._vllm):
            m.generation_tokens.inc(num_tokens)
        if gap_s is not None and num_tokens:
            per_token = gap_s / num_tokens
            for histogram in (self._ours.inter_token, self._vllm.tpot, self._vllm.itl):
                for _ in range(num_tokens):
                    histogram.observe(per_token)

    def finished(
        self, reason: FinishReason, e2e_s: float, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:
        """One sequence ended, `e2e_s` after its request arrived."""
        self._ours.e2e.observe(e2e_s)
        self._ours.requests.labels(reason.value).inc()
        v = self._vllm
        v.e2e.observe(e2e_s)
        v.success.labels(v.model_name, reason.vllm).inc()
        v.request_prompt_tokens.observe(num_prompt_tokens)
        v.request_generation_tokens.observe(num_output_tokens)

    def refused(self, code: str) -> None:
        """One error answer, by its ApiError code."""
        self._ours.rejected.labels(code).inc()

    def token_totals(self) -> tuple[int, int]:
        """(prompt tokens, generated tokens) counted so far."""
        return self.num_prompt_tokens, self.num_generation_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _OurMetrics:
    """The `pagedserve_*` metrics the web layer records."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Time between streamed tokens (one observation per token after the first)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "End-to-end latency of each sequence, from its request's arrival",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Tokens generated", registry=r
        )
        self.requests = Counter(
            "pagedserve_requests",
            "Finished sequences by reason (stop, length, abort, timeout, error)",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "pagedserve_requests_rejected",
            "Error answers (HTTP error bodies, SSE error events, WebSocket error events), "
            "by error code",
            ["reason"],
            registry=r,
        )


class _VllmMetrics:
    """The `vllm:*` metrics the web layer records, each bound to `model_name`."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        lengths = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(
                model_name
            )

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=r).labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            VLLM_TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Seconds per output token after the first (same as vllm:inter_token_latency_seconds).",
            VLLM_ITL_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive output tokens of a request.",
            VLLM_ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from a request's arrival to the end of each of its sequences.",
            VLLM_E2E_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Prompt length of each finished sequence, in tokens.",
            lengths,
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Tokens generated by each finished sequence.", lengths
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of the requests served so far."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated so far.")
        self.success = Counter(
            "vllm:request_success",
            "Finished sequences, by finished_reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in dict.fromkeys(reason.vllm for reason in FinishReason):
            self.success.labels(model_name, reason)  # every reason shows, at 0 until used


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's request-length buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class EngineCollector:
    """The engine's and the supervisor's numbers, read at scrape time from ONE
    `EngineStats` and one `WatchStats` snapshot: gauges for levels, counters for totals
    (`# TYPE ... counter`, the sample named `..._total`), under both vocabularies."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        watch: Callable[[], WatchStats],
        model_name: str,
    ) -> None:
        self.stats, self.watch, self.model_name = stats, watch, model_name

    def collect(self) -> Iterator[Metric]:
        stats, watch = self.stats(), self.watch()
        model = {"model_name": self.model_name}
        tables = (
            (stats, ENGINE_GAUGES, GaugeMetricFamily, {}),
            (stats, ENGINE_COUNTERS, CounterMetricFamily, {}),
            (watch, WATCH_GAUGES, GaugeMetricFamily, {}),
            (watch, WATCH_COUNTERS, CounterMetricFamily, {}),
            (stats, VLLM_GAUGES, GaugeMetricFamily, model),
            (stats, VLLM_COUNTERS, CounterMetricFamily, model),
        )
        for snapshot, table, family, labels in tables:
            for name, (doc, field) in table.items():
                metric = family(name, doc, labels=list(labels))
                metric.add_metric(list(labels.values()), float(getattr(snapshot, field)))
                yield metric
        yield accepted_per_position(stats, self.model_name)
        yield expert_tokens(watch, self.model_name)


def expert_tokens(watch: WatchStats, model_name: str) -> Metric:
    """`pagedserve_moe_expert_tokens{expert}`: a mixture of experts' (token, expert)
    assignments so far, per expert, summed over its MoE layers (no samples for a dense
    model): the load expert parallelism places on each expert's rank."""
    return _counts_by_index(
        "pagedserve_moe_expert_tokens",
        "Mixture of experts: (token, expert) assignments so far, per expert, over all MoE layers",
        "expert",
        watch.expert_load,
        model_name,
    )


def accepted_per_position(stats: EngineStats, model_name: str) -> Metric:
    """vLLM's `spec_decode_num_accepted_tokens_per_pos{position}`: drafts accepted as the
    (position + 1)-th of their step, so far."""
    return _counts_by_index(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Speculative decoding: draft tokens accepted so far, by their position in the step.",
        "position",
        stats.spec_decode_num_accepted_tokens_per_pos,
        model_name,
    )


def _counts_by_index(
    name: str, doc: str, label: str, counts: Sequence[int], model_name: str
) -> Metric:
    """A counter family with one sample per index of `counts`, labelled `label`."""
    metric = CounterMetricFamily(name, doc, labels=["model_name", label])
    for index, count in enumerate(counts):
        metric.add_metric([model_name, str(index)], float(count))
    return metric


class ReplicaCollector:
    """Per replica (a single engine is replica 0): `pagedserve_replica_healthy{replica}`,
    1 while it serves, 0 while it restarts or is down, and its own levels from
    REPLICA_GAUGES (the unlabelled metrics merge the serving replicas')."""

    def __init__(
        self,
        statuses: Callable[[], Sequence[EngineStatus]],
        stats: Callable[[], Sequence[EngineStats]],
    ) -> None:
        self.statuses, self.stats = statuses, stats

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "pagedserve_replica_healthy",
            "1 while the replica serves requests, 0 while it restarts or is down",
            labels=["replica"],
        )
        for replica, status in enumerate(self.statuses()):
            healthy.add_metric([str(replica)], float(status.serves))
        yield healthy
        stats = self.stats()
        for name, (doc, field) in REPLICA_GAUGES.items():
            metric = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica, snapshot in enumerate(stats):
                metric.add_metric([str(replica)], float(getattr(snapshot, field)))
            yield metric


# metric name -> (help, EngineStats field or property); every field has one.
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "pagedserve_kv_blocks_total": ("KV cache blocks", "num_blocks"),
    "pagedserve_kv_blocks_used": ("KV cache blocks in use", "num_used_blocks"),
    "pagedserve_kv_blocks_free": (
        "KV cache blocks free (cached ones nobody holds included)",
        "num_free_blocks",
    ),
    "pagedserve_kv_slot_utilization": (
        "Token slots holding real tokens / slots allocated, at the last step",
        "kv_slot_utilization",
    ),
    "pagedserve_mean_kv_slot_utilization": (
        "Token slots holding real tokens / slots allocated, over all steps",
        "mean_kv_slot_utilization",
    ),
    "pagedserve_num_requests_running": ("Requests running", "num_running"),
    "pagedserve_num_requests_waiting": ("Requests waiting in the scheduler", "num_waiting"),
    "pagedserve_num_requests_swapped": ("Requests swapped out to CPU", "num_swapped"),
    "pagedserve_prefix_cache_hit_rate": (
        "Prompt tokens found in the prefix cache / prompt tokens looked up",
        "prefix_cache_hit_rate",
    ),
    "pagedserve_kv_blocks_cached": (
        "Blocks holding a cached prefix (owned or free)",
        "num_cached_blocks",
    ),
    "pagedserve_kv_blocks_swapped": ("CPU swap blocks in use", "num_swapped_blocks"),
    "pagedserve_kv_sharing_saving": (
        "1 - blocks owned / blocks the block tables hold, at the last step",
        "kv_sharing_saving",
    ),
    "pagedserve_mean_kv_sharing_saving": (
        "1 - blocks owned / blocks the block tables hold, over all steps",
        "mean_kv_sharing_saving",
    ),
    "pagedserve_model_weights_bytes": (
        "Bytes of the model's weights on the worker(s), quantized ones in their blocks",
        "weights_bytes",
    ),
    "pagedserve_kv_cache_bytes": (
        "Bytes of the device KV cache on the worker(s)",
        "kv_cache_bytes",
    ),
    "pagedserve_spec_decode_acceptance_rate": (
        "Speculative decoding: draft tokens accepted / verified, so far",
        "spec_decode_acceptance_rate",
    ),
}
# totals since the engine started (exposed as NAME_total)
ENGINE_COUNTERS: dict[str, tuple[str, str]] = {
    "pagedserve_num_preemptions": ("Preemptions so far", "num_preemptions"),
    "pagedserve_num_steps": ("Model steps planned so far", "num_steps"),
    "pagedserve_prefix_cache_queried_tokens": (
        "Prompt tokens looked up in the prefix cache so far",
        "prefix_cache_queried_tokens",
    ),
    "pagedserve_prefix_cache_hit_tokens": (
        "Prompt tokens found in the prefix cache so far (not computed)",
        "prefix_cache_hit_tokens",
    ),
    "pagedserve_prefix_cache_evictions": ("Cached blocks evicted so far", "num_cache_evictions"),
    "pagedserve_prompt_tokens_computed": (
        "Prompt tokens computed here so far (not found in the prefix cache nor loaded from "
        "a prefill instance; recomputed ones count again)",
        "num_prompt_tokens_computed",
    ),
    "pagedserve_kv_transfer_loaded_tokens": (
        "Prompt tokens whose KV a prefill instance computed, loaded here so far",
        "kv_transfer_loaded_tokens",
    ),
    "pagedserve_num_swaps": ("Preemptions by swapping out so far", "num_swaps"),
    "pagedserve_spec_decode_num_drafts": (
        "Speculative decoding: verifications so far (a sequence's drafts in one step)",
        "spec_decode_num_drafts",
    ),
    "pagedserve_spec_decode_num_draft_tokens": (
        "Speculative decoding: draft tokens verified so far",
        "spec_decode_num_draft_tokens",
    ),
    "pagedserve_spec_decode_num_accepted_tokens": (
        "Speculative decoding: draft tokens accepted so far",
        "spec_decode_num_accepted_tokens",
    ),
}
REPLICA_GAUGES: dict[str, tuple[str, str]] = {
    "pagedserve_replica_kv_blocks_used": ("KV cache blocks in use, per replica", "num_used_blocks"),
    "pagedserve_replica_num_requests_running": ("Requests running, per replica", "num_running"),
    "pagedserve_replica_num_requests_waiting": ("Requests waiting, per replica", "num_waiting"),
}
WATCH_GAUGES: dict[str, tuple[str, str]] = {
    "pagedserve_num_requests_over_deadline": (
        "Open requests older than --request-timeout (the watchdog ends them; "
        "above 0 for long means requests are stuck)",
        "num_over_deadline",
    ),
    "pagedserve_oldest_request_age_seconds": (
        "Age of the oldest open request",
        "oldest_request_s",
    ),
    "pagedserve_worker_silence_seconds": (
        "Seconds since the worker's last heartbeat",
        "worker_silent_s",
    ),
}
WATCH_COUNTERS: dict[str, tuple[str, str]] = {
    "pagedserve_num_timed_out_requests": (
        "Requests ended by --request-timeout so far",
        "num_timed_out",
    ),
    "pagedserve_num_worker_restarts": (
        "Dead or stalled workers replaced so far (--max-worker-restarts)",
        "num_restarts",
    ),
}
# vLLM's names for the same numbers (each labelled model_name)
VLLM_GAUGES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("Requests the scheduler is running.", "num_running"),
    "vllm:num_requests_waiting": ("Requests waiting for the scheduler.", "num_waiting"),
    "vllm:num_requests_swapped": ("Requests swapped out to CPU memory.", "num_swapped"),
    "vllm:kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0 to 1).", "kv_cache_usage"),
    "vllm:gpu_cache_usage_perc": (
        "Fraction of KV cache blocks in use (0 to 1); the older name of vllm:kv_cache_usage_perc.",
        "kv_cache_usage",
    ),
}
VLLM_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:prefix_cache_queries": (
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queried_tokens",
    ),
    "vllm:prefix_cache_hits": (
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hit_tokens",
    ),
    "vllm:num_preemptions": (
        "Preemptions so far.",
        "num_preemptions",
    ),
    "vllm:spec_decode_num_drafts": (
        "Speculative decoding: verifications so far (a sequence's drafts in one step).",
        "spec_decode_num_drafts",
    ),
    "vllm:spec_decode_num_draft_tokens": (
        "Speculative decoding: draft tokens verified so far.",
        "spec_decode_num_draft_tokens",
    ),
    "vllm:spec_decode_num_accepted_tokens": (
        "Speculative decoding: draft tokens accepted so far.",
        "spec_decode_num_accepted_tokens",
    ),
}
