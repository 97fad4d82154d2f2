"""The linear layers' GEMM alone: torch's linear vs oneDNN over a prepacked weight.

    python bench/gemm.py --out bench/results/gemm.json
    python bench/gemm.py --rows 1 16 64 256 --repeats 30

Shapes: every distinct linear layer of the 58M Llama (hidden 512) and SmolLM2-135M
(hidden 576), as [out, in], at each row count (tokens in a step). Both sides get the same
weight and input, the same threads; median of `--repeats` calls after 3 warm-up calls,
the two kernels alternating shape by shape. The ratio is torch / packed (> 1: packing
is faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import invocation, write_report  # noqa: E402
from timing import median_seconds  # noqa: E402

from cuda_ext.packed_gemm import PackedWeight, packed_gemm_support  # noqa: E402

SHAPES = {  # name -> [out, in]
    "58M qkv": (1536, 512),
    "58M gate_up": (2752, 512),
    "58M down": (512, 1376),
    "58M lm_head": (32000, 512),
    "SmolLM2 qkv": (960, 576),
    "SmolLM2 gate_up": (3072, 576),
    "SmolLM2 down": (576, 1536),
    "SmolLM2 lm_head": (49152, 576),
}


def median_ms(fn, repeats: int) -> float:
    return round(median_seconds(fn, repeats, warmup=3) * 1e3, 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    why_not = packed_gemm_support(torch.float32)
    if why_not is not None:
        print(f"error: {why_not}", file=sys.stderr)
        return 2
    results = []
    for name, (out_f, in_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f)
        packed = PackedWeight(weight)
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            plain = median_ms(lambda x=x, w=weight: F.linear(x, w), args.repeats)
            fast = median_ms(lambda x=x, k=packed: k(x, None), args.repeats)
            results.append({"shape": name, "out": out_f, "in": in_f, "rows": rows,
                            "torch_ms": plain, "packed_ms": fast,
                            "torch_over_packed": round(plain / fast, 2)})  # fmt: skip
            print(f"[gemm] {name} rows {rows}: {plain} vs {fast} ms", file=sys.stderr)
    from e2e import machine_info

    report = {"command": invocation(__file__), "machine": machine_info(),
              "threads": args.threads, "dtype": "float32", "results": results}  # fmt: skip
    write_report(report, args.out, lambda png: plot(report, png))
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    shapes = list(dict.fromkeys(r["shape"] for r in report["results"]))
    rows = sorted({r["rows"] for r in report["results"]})
    width = 0.8 / len(rows)
    for i, n in enumerate(rows):
        values = [next(r["torch_over_packed"] for r in report["results"]
                       if r["shape"] == s and r["rows"] == n) for s in shapes]  # fmt: skip
        ax.bar([j + i * width for j in range(len(shapes))], values, width, label=f"{n} rows")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=7)
    ax.set_ylabel("torch linear / oneDNN packed (time)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
