"""KV memory saved by sharing: parallel sampling and beam search, as in the paper.

    python bench/sharing.py --out bench/results/sharing.json   # the default run
    python bench/sharing.py --quick                            # smoke test

For each dataset (Alpaca, ShareGPT from ../shared/data) and each mode (parallel
sampling n = 2, 4, 6; beam width 2, 4, 6) the offline engine runs the same requests,
and after every step records the blocks the block tables hold (what they would need
without sharing) and the blocks actually owned. The saving is the paper's: blocks saved
by sharing / blocks needed without sharing, over all steps. Prefix caching is off, so
only a request's own sequences share.

The model has random weights at a small shape: the saving depends on the lengths and on
how sequences fork, not on the model's quality, but beams of a trained model fork and
die differently, so the beam figures are this engine's, on noise.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import write_report  # noqa: E402
from workload import SharedDataMissing, sample_workload  # noqa: E402

PAPER = {  # the quote of the paper's ranges (saving, fraction)
    ("alpaca", "parallel"): (0.06, 0.10),
    ("sharegpt", "parallel"): (0.16, 0.30),
    ("alpaca", "beam"): (0.38, 0.55),
    ("sharegpt", "beam"): (0.44, 0.66),
}
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=32000,
)


def write_model(directory: Path, max_model_len: int) -> None:
    """A random-weight Llama saved in HF format (safetensors), seeded."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    config = hf.LlamaConfig(**SHAPE, max_position_embeddings=max_model_len)
    hf.LlamaForCausalLM(config).save_pretrained(directory)


def run_mode(model_dir: str, workload, mode: str, width: int, args) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        skip_tokenizer_init=True,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
        seed=0,
    )
    if mode == "parallel":
        params = [
            SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(workload.output_lens)
        ]
    else:
        params = [
            SamplingParams(
                use_beam_search=True, n=width, temperature=0, max_tokens=n, ignore_eos=True
            )
            for n in workload.output_lens
        ]
    start = time.perf_counter()
    llm.generate(workload.prompts, params, use_tqdm=False)
    stats = llm.stats()
    return {
        "mode": mode,
        "width": width,
        "saving": round(stats.mean_kv_sharing_saving, 4),
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "seconds": round(time.perf_counter() - start, 2),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (a PNG beside it)")
    p.add_argument("--quick", action="store_true", help="10 prompts per dataset, widths 2, 4")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--datasets", default="alpaca,sharegpt")
    p.add_argument("--widths", default="2,4,6")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.widths = 10, "2,4"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    datasets = args.datasets.split(",")
    widths = [int(w) for w in args.widths.split(",")]
    try:
        workloads = {
            d: sample_workload(
                d, args.num_prompts, args.seed, args.max_model_len, max_output=args.max_output_len
            )
            for d in datasets
        }
    except SharedDataMissing as exc:
        print(f"sharing: {exc}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.max_model_len)
        for d, workload in workloads.items():
            for mode in ("parallel", "beam"):
                for width in widths:
                    row = {"dataset": d, **run_mode(tmp, workload, mode, width, args)}
                    row["paper_range"] = PAPER[(d, mode)]
                    rows.append(row)
                    print(
                        f"[sharing] {d:8s} {mode:8s} width {width}: saved "
                        f"{row['saving']:.1%} (paper {row['paper_range'][0]:.0%}-"
                        f"{row['paper_range'][1]:.0%}) in {row['seconds']} s",
                        file=sys.stderr,
                    )
    report = {
        "command": " ".join(["python", "bench/sharing.py", *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "model": {"random_weights": True, **SHAPE, "max_model_len": args.max_model_len},
        "block_size": args.block_size,
        "workloads": {d: w.summary() for d, w in workloads.items()},
        "results": rows,
    }
    write_report(report, args.out, lambda png: plot(rows, png))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, mode in zip(axes, ("parallel", "beam"), strict=True):
        for d, color in (("alpaca", "tab:blue"), ("sharegpt", "tab:orange")):
            pts = [r for r in rows if r["mode"] == mode and r["dataset"] == d]
            if not pts:
                continue
            ax.plot(
                [r["width"] for r in pts],
                [100 * r["saving"] for r in pts],
                "o-",
                color=color,
                label=d,
            )
            lo, hi = PAPER[(d, mode)]
            ax.axhspan(100 * lo, 100 * hi, color=color, alpha=0.12)
        ax.set_title("parallel sampling (n)" if mode == "parallel" else "beam search (width)")
        ax.set_xlabel("n" if mode == "parallel" else "beam width")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    fig.suptitle("Memory saved by sharing (lines: ours; bands: the paper's ranges)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
