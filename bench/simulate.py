"""Reproduce the paper at its own scale: the real scheduler and block manager on a
virtual clock, with a cost model for the model step (calibrated once a GPU run
exists, the presets' guesses until then).

    python bench/simulate.py --preset opt-13b-a100 --dataset sharegpt \
        --rates 1 2 3 4 5 6 --refine 3 --duration 3600 \
        --out bench/results/simulate_sharegpt.json

For each system and request rate: a Poisson trace of `rate * duration` requests whose
(prompt, output) lengths are drawn from the dataset, run through `engine.sim.Simulator`
(the real `EngineCore`, a model-free worker, step times from the preset's `CostModel`).
Reported per point: mean normalized latency (end-to-end latency / output tokens, the
paper's Fig. 12), the average number of requests in a batch (Fig. 13), the mean step's
duration and tokens computed, p50/p90 latency, TTFT, preemptions, KV memory shares,
sharing savings, prefix hits, and the simulated and wall seconds. A system's sustained
rate is the rate at which its mean normalized latency reaches `--slo` s/token,
interpolated between the rates run (`--refine K` first bisects the bracket around it K
more times).

Workloads (`--dataset`, see `bench/sim_workloads.py`): sharegpt, alpaca, mooncake,
prefix-1shot, prefix-5shot and chatbot; `--n` parallel samples or `--beam-width` beam
search per request. `--overhead-ms` replaces the preset's per-step overhead (a guess
until a GPU run calibrates it). Writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.sim_workloads import WORKLOADS, make_trace, mean_lengths, workload_lengths  # noqa: E402
from engine.config import PreemptionMode, SchedulerConfig  # noqa: E402
from engine.sim.baselines.reservation import ReservationPolicy  # noqa: E402
from engine.sim.cost_model import PRESETS, CostModel, preset  # noqa: E402
from engine.sim.memory_shares import KVMemoryShares  # noqa: E402
from engine.sim.simulator import SimulationResult, Simulator, SimulatorConfig  # noqa: E402

MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
BASELINES = tuple(ReservationPolicy)  # contiguous-max, -pow2, -oracle
PAPER_FIGURES = {"prefix-1shot": "Fig. 16", "prefix-5shot": "Fig. 16", "chatbot": "Fig. 17"}
SYSTEMS = ("paged", "paged-swap", "paged-prefix", "paged-no-sharing", *BASELINES)


def simulator_config(system: str, cost: CostModel, block_size: int = BLOCK_SIZE) -> SimulatorConfig:
    """The engine each system name stands for (iteration-level scheduling for all):
    `paged` recomputes preempted requests, `paged-swap` swaps them to a CPU space as
    large as the GPU cache, `paged-prefix` also caches prefixes, `paged-no-sharing`
    copies what parallel samples would share; `contiguous-*` are the paper's Orca
    baselines (`engine/sim/baselines/contiguous_kv_cache.py`)."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    scheduler = SchedulerConfig(256, MAX_MODEL_LEN, MAX_MODEL_LEN)
    num_blocks = cost.num_blocks(block_size)
    if system in BASELINES:
        policy = ReservationPolicy(system)
        return SimulatorConfig(scheduler, num_blocks, block_size, allocator=policy)
    if system == "paged-no-sharing":
        return SimulatorConfig(scheduler, num_blocks, block_size, share_blocks=False)
    if system == "paged-swap":
        swap = PreemptionMode.SWAP
        return SimulatorConfig(scheduler, num_blocks, block_size, False, swap, num_blocks)
    return SimulatorConfig(scheduler, num_blocks, block_size, system == "paged-prefix")


def run_point(
    system: str, cost: CostModel, lengths, rate: float, args, block_size: int, label: str
) -> dict:
    """One system at one rate and block size (`label` names the series)."""
    trace = make_trace(
        args.dataset,
        lengths,
        rate,
        args.duration,
        seed=args.seed,
        n=args.n,
        beam_width=args.beam_width,
        max_model_len=MAX_MODEL_LEN,
    )
    start = time.perf_counter()
    result = Simulator(simulator_config(system, cost, block_size), cost).run(trace)
    point = summarize(system, rate, result, time.perf_counter() - start)
    return {**point, "system": label, "allocator": system, "block_size": block_size}


def summarize(system: str, rate: float, result: SimulationResult, wall_s: float) -> dict:
    latencies = sorted(r.latency_s for r in result.finished)
    return {
        "system": system,
        "rate": rate,
        "num_requests": len(result.requests),
        "mean_normalized_latency_s": result.mean_normalized_latency(),
        "mean_batched_requests": result.mean_batch_size(),
        "p50_latency_s": statistics.median(latencies),
        "p90_latency_s": latencies[int(0.9 * (len(latencies) - 1))],
        "mean_ttft_s": result.mean_ttft(),
        "num_preemptions": result.num_preemptions,
        "num_swaps": result.stats.num_swaps,
        "kv_used_by_tokens": result.used_by_tokens(),
        "kv_memory_shares": result.mean_memory_shares(),
        "kv_sharing_saving": None if system in BASELINES else result.stats.mean_kv_sharing_saving,
        "prefix_hit_rate": result.stats.prefix_cache_hit_tokens
        / max(1, result.stats.prefix_cache_queried_tokens),
        "num_steps": len(result.steps),
        "mean_step_s": sum(s.duration_s for s in result.steps) / max(1, len(result.steps)),
        "mean_step_tokens": sum(s.num_tokens for s in result.steps) / max(1, len(result.steps)),
        "simulated_s": result.end_s,
        "wall_s": wall_s,
    }


def sustained_rate(points: list[dict], system: str, slo: float) -> float | None:
    """The request rate at which the system's mean normalized latency reaches `slo`
    s/token: interpolated (log latency, linear rate) between the last rate under it and
    the first over it; the highest rate run when none is over; None when even the
    lowest is over."""
    curve = sorted(
        (p["rate"], p["mean_normalized_latency_s"]) for p in points if p["system"] == system
    )
    under = [(r, lat) for r, lat in curve if lat <= slo]
    if not under:
        return None
    r1, l1 = under[-1]
    over = [(r, lat) for r, lat in curve if r > r1 and lat > slo]
    if not over:
        return r1
    r2, l2 = over[0]
    return r1 + (r2 - r1) * math.log(slo / l1) / math.log(l2 / l1)


def refine(series: list[dict], slo: float, times: int, run) -> list[dict]:
    """`times` more points of one system, each at the middle of the bracket around its
    sustained rate (the last rate under `slo` and the next one over it); none when the
    rates run do not bracket it."""
    added: list[dict] = []
    for _ in range(times):
        curve = sorted(
            ((p["rate"], p["mean_normalized_latency_s"]) for p in series + added),
        )
        under = [r for r, lat in curve if lat <= slo]
        over = [r for r, lat in curve if under and r > under[-1] and lat > slo]
        if not over:
            break
        added.append(run(round((under[-1] + over[0]) / 2, 4)))
    return added


def capacity_search(run, slo: float, start: float, bisections: int, max_doublings: int = 8):
    """One system's points from `run(rate)`: from `start`, doubling (or halving) the
    rate until the mean normalized latency brackets `slo`, then `bisections` more in the
    bracket; `sustained_rate` of the points is the capacity."""
    points = [run(start)]
    step = 2.0 if points[0]["mean_normalized_latency_s"] <= slo else 0.5
    for _ in range(max_doublings):
        rate = round(points[-1]["rate"] * step, 4)
        points.append(run(rate))
        if (points[-1]["mean_normalized_latency_s"] <= slo) != (step == 2.0):
            break
    return points + refine(points, slo, bisections, run)


def _plot_memory_shares(ax, report: dict) -> None:
    """Where each system's KV slots went at the highest rate run (paper Fig. 2)."""
    shares = [f.name for f in dataclasses.fields(KVMemoryShares)]
    top = {}
    for point in report["points"]:
        if point["rate"] >= top.get(point["system"], {}).get("rate", -1):
            top[point["system"]] = point
    bottom = [0.0] * len(top)
    for share in shares:
        values = [100 * top[s]["kv_memory_shares"].get(share, 0) for s in top]
        ax.bar(list(top), values, bottom=bottom, label=share)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("% of KV slots")
    ax.set_title("KV slots at the highest rate (paper Fig. 2)")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=7)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for system in report["systems"]:
        points = [p for p in report["points"] if p["system"] == system]
        rates = [p["rate"] for p in points]
        a.plot(rates, [p["mean_normalized_latency_s"] for p in points], marker="o", label=system)
        b.plot(rates, [p["mean_batched_requests"] for p in points], marker="o", label=system)
    a.set_xlabel("request rate (req/s)")
    a.set_ylabel("normalized latency (s/token)")
    a.set_yscale("log")
    a.axhline(report["slo_s_per_token"], color="grey", linestyle=":", linewidth=1)
    figure = PAPER_FIGURES.get(report["dataset"], "Fig. 12")
    a.set_title(f"{report['preset']}, {report['dataset']} (paper {figure})")
    b.set_xlabel("request rate (req/s)")
    b.set_title("average batched requests (paper Fig. 13)")
    _plot_memory_shares(c, report)
    for ax in (a, b):
        ax.legend()
    fig.suptitle(report["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report_header(script: str, argv: list[str] | None, ns, cost: CostModel) -> dict:
    """What every simulation report starts with: how it was made and on what setup."""
    return {
        "command": f"python {script} " + " ".join(argv or sys.argv[1:]),
        "machine": platform.machine(),
        "preset": ns.preset,
        "cost_model": cost.__dict__,
        "dataset": ns.dataset,
    }


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="opt-13b-a100", choices=sorted(PRESETS))
    p.add_argument("--overhead-ms", type=float, help="per-step overhead (default: the preset's)")
    p.add_argument("--dataset", default="sharegpt", choices=WORKLOADS)
    p.add_argument("--mooncake-requests", type=int, default=3000)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    p.add_argument("--duration", type=float, default=3600.0, help="trace seconds per rate")
    p.add_argument(
        "--systems",
        nargs="+",
        default=["paged", *BASELINES],
        choices=SYSTEMS,
        help="default: ours and the three Orca baselines",
    )
    p.add_argument("--n", type=int, default=1, help="parallel samples per request")
    p.add_argument("--beam-width", type=int, default=0, help="beam search of this width")
    p.add_argument(
        "--block-sizes", type=int, nargs="+", default=[BLOCK_SIZE], help="tokens per KV block"
    )
    p.add_argument("--slo", type=float, default=0.2, help="s/token for the sustained rate")
    p.add_argument(
        "--refine", type=int, default=0, help="bisections of each sustained rate's bracket"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/simulate.json")
    ns = p.parse_args(argv)
    if ns.n < 1 or ns.beam_width < 0 or (ns.n > 1 and ns.beam_width):
        p.error("--n must be >= 1 and --beam-width >= 0, and only one of them may be set")
    if ns.refine < 0:
        p.error(f"--refine must be >= 0, got {ns.refine}")
    if ns.overhead_ms is not None and ns.overhead_ms < 0:
        p.error(f"--overhead-ms must be >= 0, got {ns.overhead_ms}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    cost = preset(ns.preset)
    if ns.overhead_ms is not None:
        cost = dataclasses.replace(cost, overhead_s=ns.overhead_ms / 1000)
    lengths = workload_lengths(ns.dataset, ns.mooncake_requests, MAX_MODEL_LEN)
    started = time.perf_counter()
    points = []
    labels = []
    for system in ns.systems:
        for block_size in ns.block_sizes:
            label = system if len(ns.block_sizes) == 1 else f"{system} b={block_size}"
            labels.append(label)

            def run(rate: float, system=system, block_size=block_size, label=label) -> dict:
                point = run_point(system, cost, lengths, rate, ns, block_size, label)
                print(json.dumps(point), flush=True)
                return point

            series = [run(rate) for rate in ns.rates]
            series += refine(series, ns.slo, ns.refine, run)
            points += sorted(series, key=lambda p: p["rate"])
    report = {
        **report_header("bench/simulate.py", argv, ns, cost),
        "n": ns.n,
        "beam_width": ns.beam_width,
        "mean_lengths": mean_lengths(ns.dataset, lengths),
        "slo_s_per_token": ns.slo,
        "systems": labels,
        "points": points,
        "sustained_rate": {s: sustained_rate(points, s, ns.slo) for s in labels},
        "wall_s": time.perf_counter() - started,
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("sustained_rate", "wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
