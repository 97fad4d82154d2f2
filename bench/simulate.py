"""Reproduce the paper at its own scale: the real scheduler and block manager on a
virtual clock, with a calibrated cost model for the model step (E11).

    python bench/simulate.py --preset opt-13b-a100 --dataset sharegpt \
        --rates 0.5 1 1.5 2 2.5 3 --duration 3600 --out bench/results/simulate_sharegpt.json

For each system and request rate: a Poisson trace of `rate * duration` requests whose
(prompt, output) lengths are drawn from the dataset, run through `engine.sim.Simulator`
(the real `EngineCore`, a model-free worker, step times from the preset's `CostModel`).
Reported per point: mean normalized latency (end-to-end latency / output tokens, the
paper's Fig. 12), the average number of requests in a batch (Fig. 13), p50/p90
latency, preemptions, and the simulated and wall seconds. A system's sustained rate is
the rate at which its mean normalized latency reaches `--slo` s/token (interpolated
between the rates run).

Datasets (lengths under the Llama 2 tokenizer, `bench/workload.py`): `sharegpt`, the
ShareGPT V3 prompts with output lengths from the Azure conversation trace (the ShareGPT
file here keeps no replies); `alpaca`, Alpaca prompts with their own answers. Writes the
JSON and a PNG beside it.
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

from engine.config import PreemptionMode, SchedulerConfig  # noqa: E402
from engine.kv.reservation import ReservationPolicy  # noqa: E402
from engine.sim.cost_model import PRESETS, CostModel, preset  # noqa: E402
from engine.sim.simulator import SimulationResult, Simulator, SimulatorConfig  # noqa: E402
from engine.sim.trace import TraceRequest, poisson_trace, replayed_trace  # noqa: E402

MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
BASELINES = tuple(ReservationPolicy)  # contiguous-max, -pow2, -oracle
SYSTEMS = ("paged", "paged-swap", "paged-prefix", "paged-no-sharing", *BASELINES)


def dataset_lengths(dataset: str) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs of every request the dataset offers here."""
    from bench.workload import sample_workload

    if dataset == "sharegpt":
        wl = sample_workload("sharegpt", 1000, max_model_len=MAX_MODEL_LEN, output_source="azure")
    elif dataset == "alpaca":
        wl = sample_workload("alpaca", 1700, max_model_len=MAX_MODEL_LEN)
    else:
        raise ValueError(f"dataset must be sharegpt or alpaca, got {dataset!r}")
    return [(len(p), o) for p, o in zip(wl.prompts, wl.output_lens, strict=True)]


def mooncake_records(limit: int) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """The Mooncake conversation trace's first `limit` requests: (arrival s, prompt
    len, output len, 512-token prefix hashes)."""
    from bench.workload import shared_path

    records = []
    with open(shared_path("mooncake")) as f:
        for line in f:
            row = json.loads(line)
            hashes = tuple(row["hash_ids"])
            records.append(
                (row["timestamp"] / 1000, row["input_length"], row["output_length"], hashes)
            )
            if len(records) == limit:
                break
    return records


def simulator_config(system: str, cost: CostModel, block_size: int = BLOCK_SIZE) -> SimulatorConfig:
    """The engine each system name stands for (iteration-level scheduling for all):
    `paged` recomputes preempted requests, `paged-swap` swaps them to a CPU space as
    large as the GPU cache, `paged-prefix` also caches prefixes, `paged-no-sharing`
    copies what parallel samples would share; `contiguous-*` are the paper's Orca
    baselines (`engine/kv/contiguous_kv_cache.py`)."""
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


def make_trace(lengths, rate: float, args) -> list[TraceRequest]:
    """A Poisson trace over `args.duration` s of dataset lengths, or the Mooncake trace
    replayed fast enough to average `rate` requests/s."""
    if args.dataset != "mooncake":
        trace = poisson_trace(lengths, rate, int(rate * args.duration), args.seed, MAX_MODEL_LEN)
        return [dataclasses.replace(r, n=args.n) for r in trace] if args.n > 1 else trace
    native = len(lengths) / (lengths[-1][0] - lengths[0][0])
    return replayed_trace(lengths, rate / native, MAX_MODEL_LEN)


def run_point(
    system: str, cost: CostModel, lengths, rate: float, args, block_size: int, label: str
) -> dict:
    """One system at one rate and block size (`label` names the series)."""
    trace = make_trace(lengths, rate, args)
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


def _mean_lengths(lengths, dataset: str) -> tuple[float, float]:
    """Mean prompt and output lengths of the dataset's requests (before clipping)."""
    if dataset == "mooncake":
        return statistics.fmean(r[1] for r in lengths), statistics.fmean(r[2] for r in lengths)
    return statistics.fmean(p for p, _ in lengths), statistics.fmean(o for _, o in lengths)


def _plot_memory_shares(ax, report: dict) -> None:
    """Where each system's KV slots went at the highest rate run (paper Fig. 2)."""
    shares = ("token", "reserved", "internal", "external", "free")
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
    a.set_title(f"{report['preset']}, {report['dataset']} (paper Fig. 12)")
    b.set_xlabel("request rate (req/s)")
    b.set_title("average batched requests (paper Fig. 13)")
    _plot_memory_shares(c, report)
    for ax in (a, b):
        ax.legend()
    fig.suptitle(report["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="opt-13b-a100", choices=sorted(PRESETS))
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "alpaca", "mooncake"])
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
    p.add_argument(
        "--block-sizes", type=int, nargs="+", default=[BLOCK_SIZE], help="tokens per KV block"
    )
    p.add_argument("--slo", type=float, default=0.2, help="s/token for the sustained rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/simulate.json")
    ns = p.parse_args(argv)
    cost = preset(ns.preset)
    if ns.dataset == "mooncake":
        lengths = mooncake_records(ns.mooncake_requests)
    else:
        lengths = dataset_lengths(ns.dataset)
    started = time.perf_counter()
    points = []
    labels = []
    for system in ns.systems:
        for block_size in ns.block_sizes:
            label = system if len(ns.block_sizes) == 1 else f"{system} b={block_size}"
            labels.append(label)
            for rate in ns.rates:
                points.append(run_point(system, cost, lengths, rate, ns, block_size, label))
                print(json.dumps(points[-1]), flush=True)
    report = {
        "command": "python bench/simulate.py " + " ".join(argv or sys.argv[1:]),
        "machine": platform.machine(),
        "preset": ns.preset,
        "cost_model": cost.__dict__,
        "dataset": ns.dataset,
        "mean_lengths": _mean_lengths(lengths, ns.dataset),
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
