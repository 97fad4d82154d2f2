"""Prefill/decode disaggregation against colocated replicas, in simulation.

Colocated: `replicas` engines, requests spread round robin, each engine prefilling and
decoding (a long prefill stalls the decodes batched with it). Disaggregated: `prefill`
engines compute each prompt (and its first token, discarded, as vLLM's P/D proxy
does), its KV crosses a `TransferLink` to one of `decode` engines, which computes no
prompt token (`SimulatorConfig.prompts_arrive_computed`) and produces every output
token. A request's TTFT runs from its arrival to its first token on the decode engine
(prefill + transfer + one decode step); TPOT is the time per output token after that.
Goodput (DistServe's): the requests that meet both SLOs, per second of the trace.

Not modelled: the prefill engines' KV held until its transfer ends, and contention on
the link (each transfer runs at the link's full bandwidth).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.sim.cost_model import CostModel
from engine.sim.simulator import RequestTimes, Simulator, SimulatorConfig
from engine.sim.trace import TraceRequest


@dataclass(frozen=True)
class TransferLink:
    """Where prompts' KV travels: `bandwidth` bytes/s per transfer, `latency_s` each."""

    bandwidth: float
    latency_s: float = 0.0

    def seconds(self, num_tokens: int, kv_bytes_per_token: float) -> float:
        return self.latency_s + num_tokens * kv_bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class Slo:
    """The service level a request must meet to count in goodput (seconds)."""

    ttft_s: float
    tpot_s: float

    def met(self, times: RequestTimes) -> bool:
        return ttft(times) <= self.ttft_s and tpot(times) <= self.tpot_s


def ttft(times: RequestTimes) -> float:
    return times.first_token_s - times.arrival_s


def tpot(times: RequestTimes) -> float:
    """Seconds per output token after the first (0 for a one-token output)."""
    if times.output_len <= 1:
        return 0.0
    return (times.finish_s - times.first_token_s) / (times.output_len - 1)


def colocated(
    trace: Sequence[TraceRequest], config: SimulatorConfig, cost: CostModel, replicas: int
) -> list[RequestTimes]:
    """Each request's times on `replicas` engines that prefill and decode."""
    times: list[RequestTimes] = []
    for part in _round_robin(trace, replicas):
        times += Simulator(config, cost).run(part).requests.values()
    return times


def disaggregated(
    trace: Sequence[TraceRequest],
    config: SimulatorConfig,
    cost: CostModel,
    prefill: int,
    decode: int,
    link: TransferLink,
) -> list[RequestTimes]:
    """Each request's times on `prefill` prefill engines and `decode` decode engines."""
    done: dict[str, float] = {}
    for part in _round_robin(trace, prefill):
        firsts = [dataclasses.replace(r, output_len=1) for r in part]
        for request_id, t in Simulator(config, cost).run(firsts).requests.items():
            done[request_id] = t.first_token_s
    handed = sorted(
        (
            dataclasses.replace(
                r,
                arrival_s=done[r.request_id] + link.seconds(r.prompt_len, cost.kv_bytes_per_token),
            )
            for r in trace
        ),
        key=lambda r: r.arrival_s,
    )
    decode_config = dataclasses.replace(config, prompts_arrive_computed=True)
    arrivals = {r.request_id: r.arrival_s for r in trace}
    times: list[RequestTimes] = []
    for part in _round_robin(handed, decode):
        for request_id, t in Simulator(decode_config, cost).run(part).requests.items():
            times.append(dataclasses.replace(t, arrival_s=arrivals[request_id]))
    return times


def goodput(times: Sequence[RequestTimes], slo: Slo, duration_s: float) -> dict:
    """Requests meeting the SLO per second, the share that does, and the mean and
    90th-percentile TTFT and TPOT."""
    met = sum(1 for t in times if slo.met(t))
    ttfts, tpots = sorted(ttft(t) for t in times), sorted(tpot(t) for t in times)
    p90 = lambda xs: xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else 0.0  # noqa: E731
    return dict(
        goodput_rps=met / duration_s,
        slo_attainment=met / len(times) if times else 0.0,
        mean_ttft_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        p90_ttft_s=p90(ttfts),
        mean_tpot_s=sum(tpots) / len(tpots) if tpots else 0.0,
        p90_tpot_s=p90(tpots),
    )


def _round_robin(trace: Sequence[TraceRequest], parts: int) -> list[list[TraceRequest]]:
    if parts < 1:
        raise ValueError(f"an instance count must be >= 1, got {parts}")
    ordered = sorted(trace, key=lambda r: r.arrival_s)
    return [ordered[i::parts] for i in range(parts)]
