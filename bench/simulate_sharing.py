"""Parallel sampling and beam search at the paper's scale (its Fig. 14 and 15):
sustained request rate and KV memory saved by sharing, per number of samples and beam
width, for ours and the Orca (Oracle) baseline, on the simulator.

    python bench/simulate_sharing.py --preset opt-13b-a100 --dataset alpaca \\
        --out bench/results/simulate_sharing.json

For each kind (parallel `--ns`, beam `--widths`), value and system, a capacity search
(`simulate.capacity_search`: doubling from `--start-rate`, then `--bisections`
bisections) finds the rate at which the mean normalized latency reaches `--slo`. The
memory saved by sharing is `paged`'s mean share of table blocks that sharing saves,
at its highest rate under the SLO. Beam search offers come from the simulator's
synthetic next-token distribution (`engine/sim/sim_worker.py`), not a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.sim_workloads import workload_lengths  # noqa: E402
from bench.simulate import (  # noqa: E402
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    capacity_search,
    report_header,
    run_point,
    sustained_rate,
)
from engine.sim.cost_model import PRESETS, preset  # noqa: E402

KINDS = ("parallel", "beam")


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="opt-13b-a100", choices=sorted(PRESETS))
    p.add_argument("--dataset", default="alpaca", choices=["alpaca", "sharegpt"])
    p.add_argument("--ns", type=int, nargs="+", default=[2, 4, 6], help="parallel samples")
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6], help="beam widths")
    p.add_argument(
        "--systems", nargs="+", default=["paged", "paged-no-sharing", "contiguous-oracle"]
    )
    p.add_argument("--duration", type=float, default=120.0, help="trace seconds per rate")
    p.add_argument("--start-rate", type=float, default=8.0)
    p.add_argument("--bisections", type=int, default=4)
    p.add_argument("--slo", type=float, default=0.2, help="s/token for the sustained rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/simulate_sharing.json")
    ns = p.parse_args(argv)
    if min(ns.ns + ns.widths) < 1:
        p.error("--ns and --widths must be >= 1")
    if not ns.start_rate > 0 or ns.bisections < 0:
        p.error("--start-rate must be > 0 and --bisections >= 0")
    return ns


def search(kind: str, value: int, system: str, cost, lengths, ns) -> list[dict]:
    """The capacity search's points of one system at one n or beam width."""
    args = argparse.Namespace(
        dataset=ns.dataset,
        duration=ns.duration,
        seed=ns.seed,
        n=value if kind == "parallel" else 1,
        beam_width=value if kind == "beam" else 0,
    )

    def run(rate: float) -> dict:
        point = run_point(system, cost, lengths, rate, args, BLOCK_SIZE, system)
        point.update(kind=kind, value=value)
        print(json.dumps(point), flush=True)
        return point

    return capacity_search(run, ns.slo, ns.start_rate / value, ns.bisections)


def summary(points: list[dict], kind: str, value: int, systems, slo: float) -> dict:
    """Sustained rates and paged's sharing saving for one kind and value."""
    mine = [p for p in points if p["kind"] == kind and p["value"] == value]
    rates = {s: sustained_rate(mine, s, slo) for s in systems}
    under = [p for p in mine if p["system"] == "paged" and p["mean_normalized_latency_s"] <= slo]
    saving = max(under, key=lambda p: p["rate"])["kv_sharing_saving"] if under else None
    return {"kind": kind, "value": value, "sustained_rate": rates, "kv_sharing_saving": saving}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    cost = preset(ns.preset)
    lengths = workload_lengths(ns.dataset, max_model_len=MAX_MODEL_LEN)
    started = time.perf_counter()
    points, summaries = [], []
    for kind, values in (("parallel", ns.ns), ("beam", ns.widths)):
        for value in values:
            for system in ns.systems:
                points += search(kind, value, system, cost, lengths, ns)
            summaries.append(summary(points, kind, value, ns.systems, ns.slo))
            print(json.dumps(summaries[-1]), flush=True)
    report = {
        **report_header("bench/simulate_sharing.py", argv, ns, cost),
        "slo_s_per_token": ns.slo,
        "systems": ns.systems,
        "summaries": summaries,
        "points": points,
        "wall_s": time.perf_counter() - started,
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps({"summaries": summaries, "wall_s": report["wall_s"]}))
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, kind in zip(axes[:2], KINDS, strict=True):
        rows = [s for s in report["summaries"] if s["kind"] == kind]
        for system in report["systems"]:
            values = [r["value"] for r in rows]
            ax.plot(values, [r["sustained_rate"][system] for r in rows], marker="o", label=system)
        label = "parallel samples n" if kind == "parallel" else "beam width"
        ax.set_xlabel(label)
        ax.set_ylabel(f"sustained req/s at {report['slo_s_per_token']} s/token")
        ax.set_title(f"{kind} ({report['preset']}, {report['dataset']}; paper Fig. 14)")
        ax.legend()
    ax = axes[2]
    for kind in KINDS:
        rows = [s for s in report["summaries"] if s["kind"] == kind]
        savings = [100 * (r["kv_sharing_saving"] or 0) for r in rows]
        ax.plot([r["value"] for r in rows], savings, marker="o", label=kind)
    ax.set_xlabel("n / beam width")
    ax.set_ylabel("% of KV blocks saved by sharing")
    ax.set_title("memory saved by sharing (paper Fig. 15)")
    ax.legend()
    fig.suptitle(report["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
