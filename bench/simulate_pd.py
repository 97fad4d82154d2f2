"""Prefill/decode disaggregation against colocated replicas, simulated at the paper's
scale: the same GPUs as N colocated engines, or as P prefill + D decode engines with
the prompts' KV crossing a link, on the Azure conversation trace's lengths (Poisson
arrivals), LLaMA-13B on A100-40GB each (`engine/sim/cost_model.py`'s preset). Reported
per request rate: goodput (requests meeting the TTFT and TPOT SLO, per second), SLO
attainment, mean and p90 TTFT and TPOT (`engine/sim/disaggregation.py`).

    python bench/simulate_pd.py --out bench/results/simulate_pd.json
    python bench/simulate_pd.py --gpus 4 --rates 2 4 6 --bandwidth-gbs 25 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from report import invocation, machine, write_report  # noqa: E402
from sim_workloads import chatbot_lengths  # noqa: E402

from engine.config import SchedulerConfig  # noqa: E402
from engine.sim.cost_model import preset  # noqa: E402
from engine.sim.disaggregation import (  # noqa: E402
    Slo,
    TransferLink,
    colocated,
    disaggregated,
    goodput,
)
from engine.sim.simulator import SimulatorConfig  # noqa: E402
from engine.sim.trace import poisson_trace  # noqa: E402

LONG_PROMPTS = [(1800, 200), (60, 300), (40, 300)]


def log(msg: str) -> None:
    print(f"[simulate_pd] {msg}", file=sys.stderr, flush=True)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup]
        ax.plot([r["rate"] for r in mine], [r["goodput_rps"] for r in mine], "o-", label=setup)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting the SLO)")
    ax.set_title("Prefill/decode disaggregation, simulated (LLaMA-13B, A100s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=4, help="engines in all (one GPU each)")
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8])
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--bandwidth-gbs", type=float, nargs="+", default=[25.0])
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-s", type=float, default=0.05)
    p.add_argument(
        "--workload",
        choices=["chat", "long-prompts"],
        default="chat",
        help="chat: the Azure conversation trace's lengths; long-prompts: a third of the "
        "requests 1,800-token prompts with 200-token answers, the rest 40-60 tokens with 300",
    )
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    cost = preset("llama-13b-a100")
    config = SimulatorConfig(
        SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048),
        num_blocks=cost.num_blocks(16),
    )
    slo = Slo(a.ttft_slo_s, a.tpot_slo_s)
    lengths = chatbot_lengths() if a.workload == "chat" else LONG_PROMPTS
    rows = []
    for rate in a.rates:
        trace = poisson_trace(lengths, rate, int(rate * a.duration_s), seed=0, max_len=2048)
        setups = {f"{a.gpus} colocated": lambda t: colocated(t, config, cost, a.gpus)}
        for bandwidth in a.bandwidth_gbs:
            link = TransferLink(bandwidth * 1e9, latency_s=0.001)
            for prefill in range(1, a.gpus):
                name = f"{prefill}P+{a.gpus - prefill}D, {bandwidth:g} GB/s"
                setups[name] = lambda t, p=prefill, link=link: disaggregated(
                    t, config, cost, p, a.gpus - p, link
                )
        for name, run in setups.items():
            row = dict(setup=name, rate=rate, requests=len(trace))
            row |= {k: round(v, 4) for k, v in goodput(run(trace), slo, a.duration_s).items()}
            rows.append(row)
            log(row)
    result = dict(
        command=invocation(__file__),
        model=cost.name,
        slo=dict(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s),
        workload=a.workload,
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
