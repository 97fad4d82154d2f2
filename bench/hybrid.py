"""Hybrid models' KV cache: the hybrid allocator vs static partitioning vs "window
ignored", and what a sliding window saves a decode step.

    python bench/hybrid.py --out bench/results/hybrid.json    # the default run
    python bench/hybrid.py --quick                            # smoke test

(a) capacity: ShareGPT requests (Azure output lengths; contexts of ~400 tokens) and
    Mooncake's long-context conversations (prompts of 13.5k tokens on average, cut to
    32k) all offered at once to the simulated engine (the real scheduler and block tables on
    a virtual clock) for a GPT-OSS-120B-like and a Gemma-3-27B-like model on one
    H100-80GB (engine/sim/hybrid_presets.py), with the same KV bytes under each
    allocator. Per allocator: KV slot waste (allocated slots not holding a token a
    layer still reads, averaged over steps; the hybrid layout's padding beside it), the
    mean and peak batch, preemptions and output tokens/s.
(b) rate: Poisson arrivals at rising rates; the mean normalized latency (s per output
    token), and the sustained rate under --slo.
(c) decode: the real engine on this CPU, a dummy-weight Mistral-shaped model with and
    without a 256-token sliding window, N sequences decoding at a 4k-token context: the
    median decode step (the later half of the steps, best of --repeats) and decode
    tokens/s (the window's saving in K/V reads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import invocation, machine, write_report  # noqa: E402

from bench.sim_workloads import make_trace, workload_lengths  # noqa: E402
from bench.simulate import sustained_rate  # noqa: E402
from engine.config import SchedulerConfig  # noqa: E402
from engine.kv.kv_cache_groups import KVCacheLayout  # noqa: E402
from engine.sim.hybrid_presets import HYBRID_PRESETS, HybridPreset, KVAllocator  # noqa: E402
from engine.sim.simulator import Simulator, SimulatorConfig  # noqa: E402

BLOCK_SIZE = 16


def sim_config(preset: HybridPreset, allocator: KVAllocator, max_len: int) -> SimulatorConfig:
    scheduler = SchedulerConfig(512, 8192, max_len)
    return SimulatorConfig(
        scheduler,
        preset.num_blocks(allocator, BLOCK_SIZE),
        BLOCK_SIZE,
        layout=preset.layout(KVAllocator.HYBRID),
        kv_allocator=allocator,
    )


def longest_sequence(config: SimulatorConfig, allocator: KVAllocator, max_len: int) -> int:
    """The most tokens one sequence can hold under `allocator` (at most `max_len`):
    every page (hybrid), its full-attention group's share (static), or all pages with
    every layer's tokens (no-window); windowed groups need their chunk and window."""
    layout, pages = config.layout, config.num_blocks
    chunk = config.scheduler.max_num_batched_tokens

    def fits(n: int) -> bool:
        if allocator is KVAllocator.NO_WINDOW:
            return -(-n // BLOCK_SIZE) <= pages
        if allocator is KVAllocator.STATIC:
            share = pages // layout.num_groups
            return all(
                KVCacheLayout((g,), 1).max_blocks_per_sequence(n, chunk, BLOCK_SIZE) <= share
                for g in layout.groups
            )
        return layout.max_blocks_per_sequence(n, chunk, BLOCK_SIZE) <= pages

    low, high = 1, max_len
    while low < high:  # the largest n that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def run_trace(preset, allocator, trace, max_len) -> dict:
    """One allocator on one trace. A request longer than the allocator can hold at
    all (`longest_sequence`) is left out of its run (it would wait forever) and
    counted."""
    config = sim_config(preset, allocator, max_len)
    longest = longest_sequence(config, allocator, max_len)
    kept = [r for r in trace if r.prompt_len + r.output_len <= longest]
    started = time.perf_counter()
    result = Simulator(config, preset.cost).run(kept)
    steps = result.steps
    outputs = sum(r.output_len for r in result.finished)
    return {
        "allocator": str(allocator),
        "num_blocks": config.num_blocks,
        "longest_sequence": longest,
        "requests_left_out": len(trace) - len(kept),
        "page_bytes": preset.page_bytes(allocator, BLOCK_SIZE),
        "kv_slot_waste": 1 - result.used_by_tokens(),
        "layout_padding_share": (
            0.0 if allocator is KVAllocator.NO_WINDOW else config.layout.padding_share
        ),
        "mean_batch": result.mean_batch_size(),
        "peak_batch": max((s.batch_size for s in steps), default=0),
        "num_preemptions": result.num_preemptions,
        "output_tokens_per_s": outputs / result.end_s if result.end_s else 0.0,
        "mean_normalized_latency_s": result.mean_normalized_latency(),
        "simulated_s": result.end_s,
        "wall_s": time.perf_counter() - started,
    }


WORKLOADS = {"sharegpt": 4096, "mooncake": 32768}  # -> max_model_len
RATES = {"gemma-3-27b-h100": [8, 12, 16, 20, 24], "gpt-oss-120b-h100": [30, 40, 50, 60, 70]}


def workload(name: str) -> list[tuple[int, int]]:
    """(prompt, output) lengths of a workload's requests."""
    if name == "mooncake":
        return [(p, o) for _, p, o, _ in workload_lengths("mooncake", 3000, WORKLOADS[name])]
    return workload_lengths(name, max_model_len=WORKLOADS[name])


def capacity(ns, name: str) -> dict:
    report = {}
    lengths, max_len = workload(name), WORKLOADS[name]
    count = ns.requests if name == "sharegpt" else ns.requests // 4
    for preset_name in ns.presets:
        preset = HYBRID_PRESETS[preset_name]
        trace = make_trace("sharegpt", lengths, 1e6, count / 1e6, max_model_len=max_len)
        rows = [run_trace(preset, a, trace, max_len) for a in KVAllocator]
        by = {r["allocator"]: r for r in rows}
        report[preset_name] = {
            "allocators": rows,
            "batch_gain_vs_static": by["hybrid"]["mean_batch"] / by["static"]["mean_batch"],
            "batch_gain_vs_no_window": by["hybrid"]["mean_batch"] / by["no-window"]["mean_batch"],
            "throughput_gain_vs_static": by["hybrid"]["output_tokens_per_s"]
            / by["static"]["output_tokens_per_s"],
        }
        print(name, preset_name, {r["allocator"]: round(r["mean_batch"], 1) for r in rows})
    return report


def rates(ns) -> dict:
    report = {}
    lengths, max_len = workload("sharegpt"), WORKLOADS["sharegpt"]
    for name in ns.presets:
        preset = HYBRID_PRESETS[name]
        points = []
        for rate in ns.rates or RATES[name]:
            trace = make_trace("sharegpt", lengths, rate, ns.duration, max_model_len=max_len)
            for allocator in KVAllocator:
                point = run_trace(preset, allocator, trace, max_len)
                points.append({**point, "system": point["allocator"], "rate": rate})
        report[name] = {
            "points": points,
            "sustained_rate": {str(a): sustained_rate(points, str(a), ns.slo) for a in KVAllocator},
        }
        print(name, report[name]["sustained_rate"], flush=True)
    return report


def decode(ns) -> dict:
    """Decode tokens/s at a long context, windowed vs full attention (real engine)."""
    import json

    from engine import LLM, SamplingParams

    rows = {}
    for label, window in (("full", None), ("window", ns.window)):
        with tempfile.TemporaryDirectory() as tmp:
            config = {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "vocab_size": 1024,
                "max_position_embeddings": ns.context + 512,
                "sliding_window": window,
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
            }
            Path(tmp, "config.json").write_text(json.dumps(config))
            llm = LLM(
                tmp,
                load_format="dummy",
                skip_tokenizer_init=True,
                max_model_len=ns.context + 512,
                max_num_batched_tokens=ns.context,
                enable_prefix_caching=False,
            )
            prompts = [[(i * 7 + j) % 1000 + 1 for j in range(ns.context)] for i in range(ns.seqs)]
            params = SamplingParams(max_tokens=ns.steps, ignore_eos=True, temperature=0)
            step_s = []  # per repeat: the median decode step (prefill steps come first)
            for r in range(ns.repeats):
                for i, prompt in enumerate(prompts):
                    llm.engine.add_request(f"{r}-{i}", prompt, params)
                times = []
                while llm.engine.has_unfinished_requests():
                    start = time.perf_counter()
                    llm.engine.step()
                    times.append(time.perf_counter() - start)
                step_s.append(statistics.median(times[-(ns.steps // 2) :]))
            best = min(step_s) * ns.steps
            rows[label] = {
                "sliding_window": window,
                "decode_step_s": best / ns.steps,
                "decode_tokens_per_s": ns.seqs * ns.steps / best,
                "attention_backend": llm.stats().attention_backend,
                "kv_blocks": llm.stats().num_blocks,
            }
            print(label, rows[label], flush=True)
    rows["speedup"] = rows["window"]["decode_tokens_per_s"] / rows["full"]["decode_tokens_per_s"]
    return {"context": ns.context, "seqs": ns.seqs, "steps": ns.steps, **rows}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacity = report.get("capacity", {})
    presets = sorted({p for rows in capacity.values() for p in rows})
    fig, axes = plt.subplots(1, len(capacity) + len(presets), figsize=(18, 4))
    for ax, (workload_name, rows) in zip(axes, capacity.items(), strict=False):
        for name in presets:
            allocators = rows[name]["allocators"]
            ax.bar(
                [f"{name.split('-h100')[0]}\n{r['allocator']}" for r in allocators],
                [r["mean_batch"] for r in allocators],
            )
        ax.set_title(f"{workload_name}: all requests at once")
        ax.set_ylabel("mean running batch")
        ax.tick_params(axis="x", labelsize=6)
    for ax, name in zip(axes[len(capacity) :], presets, strict=True):
        points = report.get("rates", {}).get(name, {}).get("points", [])
        for allocator in KVAllocator:
            curve = sorted(
                (p["rate"], p["mean_normalized_latency_s"])
                for p in points
                if p["system"] == allocator
            )
            if curve:
                ax.plot(*zip(*curve, strict=True), marker="o", label=str(allocator))
        ax.set_title(name)
        ax.set_xlabel("requests/s")
        ax.set_ylabel("s per output token")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["capacity", "rates", "decode"])
    p.add_argument(
        "--presets", nargs="+", default=sorted(HYBRID_PRESETS), choices=sorted(HYBRID_PRESETS)
    )
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS), choices=sorted(WORKLOADS))
    p.add_argument("--rates", type=float, nargs="+", help="req/s (default: per preset)")
    p.add_argument("--duration", type=float, default=60.0, help="trace seconds per rate")
    p.add_argument("--slo", type=float, default=0.05, help="s/token for the sustained rate")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--out")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests, ns.rates, ns.duration = 200, [8, 32], 10.0
        ns.context, ns.seqs, ns.steps, ns.repeats = 1024, 2, 4, 1
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    report = {"command": invocation(__file__), "machine": machine(), "block_size": BLOCK_SIZE}
    started = time.perf_counter()
    if "capacity" in ns.parts:
        report["capacity"] = {name: capacity(ns, name) for name in ns.workloads}
    if "rates" in ns.parts:
        report["rates"] = rates(ns)
    if "decode" in ns.parts:
        report["decode"] = decode(ns)
    report["mean_lengths"] = {
        name: [statistics.mean(p for p, _ in w), statistics.mean(o for _, o in w)]
        for name, w in ((n, workload(n)) for n in ns.workloads)
    }
    report["wall_s"] = time.perf_counter() - started
    write_report(report, ns.out, lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
