"""When pipeline and expert parallelism pay, simulated at paper scale (analytic models:
`engine/sim/pipeline.py`, `engine/sim/expert_dispatch.py`; the cost model's defaults,
2 ms of overhead a step and 80% of peak bandwidth and FLOP/s).

(a) the pipeline bubble and relative throughput against micro-batches for 2, 4, 8 stages;
(b) Llama-70B-like and Llama-405B-like decode on 16 A100s or H100s in two hosts: TP=8 x
    PP=2 (stages joined across the hosts) against TP=16 (every all-reduce across them);
(c) MoE communication per decode step, expert parallelism's two all-to-alls against
    tensor parallelism's all-reduce, Mixtral-like and DeepSeek-V3-like, and the crossover.

Links (bandwidth each way, latency per message): NVLink 300 GB/s on A100 and 450 GB/s on
H100, 1 us; Ethernet across hosts 25 or 100 Gb/s, one NIC per host, 20 us; InfiniBand
8 x 400 Gb/s per host, 400 GB/s for a host's traffic (50 GB/s per GPU), 5 us.

    python bench/simulate_parallel.py --out bench/results/simulate_parallel.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from report import invocation, machine, write_report  # noqa: E402

from engine.sim.disaggregation import TransferLink  # noqa: E402
from engine.sim.expert_dispatch import (  # noqa: E402
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    MoeLayout,
    Routing,
    dispatch_bytes,
    ep_step,
    ep_winning_range,
    tp_step,
)
from engine.sim.pipeline import (  # noqa: E402
    A100_80GB,
    H100_80GB,
    LLAMA_70B,
    LLAMA_405B,
    ParallelLayout,
    bubble_fraction,
    decode_idle_fraction,
    decode_rate,
    kv_slots,
)

NVLINK = {A100_80GB.name: TransferLink(300e9, 1e-6), H100_80GB.name: TransferLink(450e9, 1e-6)}
ACROSS_HOSTS = {
    "25 GbE": TransferLink(25e9 / 8, 20e-6),
    "100 GbE": TransferLink(100e9 / 8, 20e-6),
    "8x400G IB": TransferLink(400e9, 5e-6),
}
IB_PER_GPU = TransferLink(50e9, 5e-6)
MICRO_BATCHES = (1, 2, 4, 8)


def log(msg: str) -> None:
    print(f"[simulate_parallel] {msg}", file=sys.stderr, flush=True)


def bubbles(batch: int, context_len: int) -> list[dict]:
    """(a): the classic bubble, the decode idle share, and Llama-70B-like decode on TP=8
    H100 stages over 100 GbE against one stage (same batch)."""
    nvlink, hop = NVLINK[H100_80GB.name], ACROSS_HOSTS["100 GbE"]
    one = decode_rate(LLAMA_70B, H100_80GB, ParallelLayout(8, tp_link=nvlink), batch, context_len)
    rows = []
    for stages in (2, 4, 8):
        for m in MICRO_BATCHES:
            layout = ParallelLayout(8, stages, m, nvlink, hop)
            rate = decode_rate(LLAMA_70B, H100_80GB, layout, batch, context_len)
            bubble = bubble_fraction(stages, m)
            rows.append(
                dict(
                    stages=stages,
                    micro_batches=m,
                    bubble=round(bubble, 4),
                    forward_relative_throughput=round(1 - bubble, 4),
                    decode_idle=round(decode_idle_fraction(stages, m), 4),
                    decode_tpot_ms=round(rate.tpot_s * 1e3, 2),
                    decode_relative_throughput=round(rate.tokens_per_s / one.tokens_per_s, 3),
                )
            )
    return rows


def layouts(nvlink: TransferLink, across: TransferLink) -> dict[str, ParallelLayout]:
    return {
        "TP=8 (one host)": ParallelLayout(8, tp_link=nvlink),
        "TP=8 x PP=2, 1 micro-batch": ParallelLayout(8, 2, 1, nvlink, across),
        "TP=8 x PP=2, 2 micro-batches": ParallelLayout(8, 2, 2, nvlink, across),
        "TP=16": ParallelLayout(16, tp_link=across),
    }


def dense(batches: list[int], context_len: int) -> list[dict]:
    """(b): each model, GPU, cross-host link, layout and batch; the speedup is against one
    GPU decoding the same batch (memory aside: `fits` says whether the layout holds it)."""
    rows = []
    for shape in (LLAMA_70B, LLAMA_405B):
        for device in (A100_80GB, H100_80GB):
            for link_name, across in ACROSS_HOSTS.items():
                for name, layout in layouts(NVLINK[device.name], across).items():
                    for batch in batches:
                        rate = decode_rate(shape, device, layout, batch, context_len)
                        one = decode_rate(shape, device, ParallelLayout(1), batch, context_len)
                        rows.append(
                            dict(
                                model=shape.name,
                                gpu=device.name,
                                across_hosts=link_name,
                                layout=name,
                                gpus=layout.num_gpus,
                                batch=batch,
                                fits=kv_slots(shape, device, layout) >= batch * context_len,
                                tpot_ms=round(rate.tpot_s * 1e3, 2),
                                tokens_per_s=round(rate.tokens_per_s),
                                tokens_per_s_per_gpu=round(rate.tokens_per_s / layout.num_gpus),
                                speedup_vs_one_gpu=round(rate.tokens_per_s / one.tokens_per_s, 2),
                            )
                        )
    return rows


def moe_setups() -> list[tuple]:
    nvlink = NVLINK[H100_80GB.name]
    return [
        (MIXTRAL_8X7B, 2, "NVLink", nvlink),
        (MIXTRAL_8X7B, 4, "NVLink", nvlink),
        (MIXTRAL_8X7B, 8, "NVLink", nvlink),
        (DEEPSEEK_V3, 8, "NVLink", nvlink),
        (DEEPSEEK_V3, 16, "IB 400G per GPU", IB_PER_GPU),
        (DEEPSEEK_V3, 32, "IB 400G per GPU", IB_PER_GPU),
        (DEEPSEEK_V3, 64, "IB 400G per GPU", IB_PER_GPU),
    ]


def routings(num_experts: int) -> dict[str, Routing]:
    return {
        "uniform": Routing.uniform(num_experts),
        "zipf 0.5": Routing.zipf(num_experts, 0.5),
        "zipf 1.0": Routing.zipf(num_experts, 1.0),
    }


def experts(tokens: list[int]) -> tuple[list[dict], list[dict]]:
    """(c): per decode step, EP against TP at each step size, and where EP wins."""
    rows, crossovers = [], []
    for shape, ranks, link_name, link in moe_setups():
        layout = MoeLayout(ranks, link, H100_80GB)
        for routing_name, routing in routings(shape.num_experts).items():
            setup = dict(model=shape.name, ranks=ranks, link=link_name, routing=routing_name)
            for n in tokens:
                ep, tp = ep_step(shape, layout, routing, n), tp_step(shape, layout, routing, n)
                rows.append(
                    setup
                    | dict(
                        tokens=n,
                        busiest_rank_bytes=round(dispatch_bytes(shape, routing, n, ranks)),
                        ep_comm_ms=round(ep.comm_s * 1e3, 3),
                        tp_comm_ms=round(tp.comm_s * 1e3, 3),
                        ep_moe_ms=round(ep.total_s * 1e3, 3),
                        tp_moe_ms=round(tp.total_s * 1e3, 3),
                    )
                )
            comm = ep_winning_range(shape, layout, routing)
            whole = ep_winning_range(shape, layout, routing, with_compute=True)
            crossovers.append(setup | dict(comm_wins_from=comm and comm[0], moe_wins=whole))
            log(crossovers[-1])
    return rows, crossovers


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _plot_bubbles(axes[0], result["bubbles"])
    _plot_dense(axes[1], result["dense"])
    _plot_experts(axes[2], result["experts"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_bubbles(ax, rows: list[dict]) -> None:
    for stages in (2, 4, 8):
        mine = [r for r in rows if r["stages"] == stages]
        ax.plot(
            [r["micro_batches"] for r in mine],
            [r["bubble"] for r in mine],
            "o-",
            label=f"S={stages}",
        )
    ax.set(xscale="log", xlabel="micro-batches M", ylabel="bubble (S-1)/(M+S-1)")
    ax.set_xticks(MICRO_BATCHES, [str(m) for m in MICRO_BATCHES])
    ax.minorticks_off()
    ax.set_title("(a) pipeline bubble, one forward pass")
    ax.legend()


def _plot_dense(ax, rows: list[dict]) -> None:
    """Tokens/s per GPU of the 16-GPU layouts on H100s at the largest batch."""
    batch = max(r["batch"] for r in rows)
    picked = [
        r for r in rows if r["gpu"] == H100_80GB.name and r["batch"] == batch and r["gpus"] == 16
    ]
    bars = list(dict.fromkeys((r["model"], r["layout"]) for r in picked))
    width = 0.8 / len(bars)
    for i, (model, layout) in enumerate(bars):
        ys = [
            next(
                r["tokens_per_s_per_gpu"]
                for r in picked
                if (r["model"], r["layout"], r["across_hosts"]) == (model, layout, link)
            )
            for link in ACROSS_HOSTS
        ]
        xs = [k + i * width for k in range(len(ACROSS_HOSTS))]
        ax.bar(xs, ys, width, label=f"{model.removesuffix('-like')}, {layout}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ACROSS_HOSTS))], list(ACROSS_HOSTS))
    ax.set(yscale="log", ylim=(5, 2e4), ylabel="decode tokens/s per GPU")
    ax.set_title(f"(b) 16 H100s in two hosts, batch {batch}")
    ax.legend(fontsize=6, loc="upper left")


def _plot_experts(ax, rows: list[dict]) -> None:
    """Mixtral-like on 8 ranks, DeepSeek-V3-like on 8, 16 and 64, uniform and Zipf 1.0."""
    shown = {(MIXTRAL_8X7B.name, 8), *((DEEPSEEK_V3.name, e) for e in (8, 16, 64))}
    for routing, style in (("uniform", "o-"), ("zipf 1.0", "x--")):
        for model, ranks in sorted(shown):
            mine = [
                r for r in rows if (r["model"], r["ranks"], r["routing"]) == (model, ranks, routing)
            ]
            ratio = [r["ep_comm_ms"] / r["tp_comm_ms"] for r in mine]
            label = f"{model.removesuffix('-like')}, E={ranks}, {routing}"
            ax.plot([r["tokens"] for r in mine], ratio, style, label=label)
    ax.axhline(1, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="tokens in the decode step", ylabel="EP comm / TP comm")
    ax.set_title("(c) MoE communication (below 1: EP moves less)")
    ax.legend(fontsize=6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 256], help="decode batch, (b)")
    p.add_argument("--context-len", type=int, default=1024, help="tokens each sequence holds")
    p.add_argument("--bubble-batch", type=int, default=256, help="decode batch, (a)")
    p.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    moe_rows, crossovers = experts(a.moe_tokens)
    result = dict(
        command=invocation(__file__),
        context_len=a.context_len,
        links=dict(
            nvlink={k: [v.bandwidth, v.latency_s] for k, v in NVLINK.items()},
            across_hosts={k: [v.bandwidth, v.latency_s] for k, v in ACROSS_HOSTS.items()},
            ib_per_gpu=[IB_PER_GPU.bandwidth, IB_PER_GPU.latency_s],
        ),
        bubbles=bubbles(a.bubble_batch, a.context_len),
        dense=dense(a.batches, a.context_len),
        experts=moe_rows,
        crossovers=crossovers,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
