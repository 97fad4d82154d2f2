"""GGUF-quantized matmul (cuda_ext.quant_gemm) against torch's linear on float weights.

    python bench/quant_gemm.py --out bench/results/quant_gemm.json
    python bench/quant_gemm.py --types Q4_0 Q8_0 --rows 1 --repeats 30
    python bench/quant_gemm.py --methods --shapes "smollm2 gate/up 3072x576" ... \
        --rows 1 8 16 32 64 256 2048 --out bench/results/quant_gemm_methods.json

`--methods` times every `cuda_ext.quant_gemm.Method` (integer dot products with
activations rounded once or twice; weights decoded into float panels for oneDNN's or
torch's GEMM) beside oneDNN over the float32 weight prepacked, per row count, and names
the method `pick_method` would choose: the figures behind its thresholds.

Shapes: Llama-3-8B's linear layers, [N, K] = [out, in]: 4096 x 4096 (attention's q/o),
14336 x 4096 (gate, up), 4096 x 14336 (down). For each type and row count M:
`quantized_matmul` (the native kernel, through the public API); for each shape and M,
float32 `F.linear` and bfloat16 `F.linear` (weight and x in bfloat16) on the first type's
weight dequantized (values do not change their time); once per shape and type, the
reference path at M = 1 (dequantize, then the float32 product).
Weights of the 32-element types are `quantize`d from a random float weight; those of the
k-quants are random blocks with sane scales (their values do not change the timing).

Every call reads a different copy of its weight, cycling through at least `--span-mib`
(default 256 MiB, 8x this machine's L3): like one decode step through a model's layers,
the weights come from DRAM, not cache. Median of `--repeats` calls after 3 warm-up
calls. GB/s is the weight's bytes (as the method stores them) over the time; the ratios
are the float linear's time over ours (> 1: ours is faster). On a shared machine, a
2-thread run is slowed whenever another process holds a core: compare runs, not calls.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import invocation, write_report  # noqa: E402
from timing import median_seconds  # noqa: E402

from cuda_ext.packed_gemm import PackedWeight, packed_gemm_support  # noqa: E402
from cuda_ext.quant_gemm import (  # noqa: E402
    BLOCK_SHAPES,
    QUANTIZABLE,
    Method,
    QuantType,
    cdiv,
    dequantize,
    pick_method,
    quantize,
    quantized_matmul,
    reference_quantized_matmul,
    supported_natively,
)

SHAPES = {  # name -> [N, K] = [out, in]
    "q/o 4096x4096": (4096, 4096),
    "gate/up 14336x4096": (14336, 4096),
    "down 4096x14336": (4096, 14336),
    "smollm2 gate/up 3072x576": (3072, 576),
    "smollm2 down 576x1536": (576, 1536),
    "smollm2 lm_head 49152x576": (49152, 576),
}
DEFAULT_SHAPES = list(SHAPES)[:3]
SCALE_OFFSETS = {  # bytes of each block's fp16 scales (d, and dmin / m)
    QuantType.Q4_0: (0,), QuantType.Q5_0: (0,), QuantType.Q8_0: (0,),
    QuantType.Q4_1: (0, 2), QuantType.Q5_1: (0, 2), QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2), QuantType.Q6_K: (208,),
}  # fmt: skip


def weight_blocks(weight: torch.Tensor, qtype: QuantType, gen: torch.Generator) -> torch.Tensor:
    """weight [N, K] quantized (the 32-element types we write), or random blocks."""
    if qtype in QUANTIZABLE:
        return quantize(weight, qtype)
    n, k = weight.shape
    elements, nbytes = BLOCK_SHAPES[qtype]
    blocks = torch.randint(0, 256, (n * cdiv(k, elements), nbytes), dtype=torch.uint8,
                           generator=gen)  # fmt: skip
    for at in SCALE_OFFSETS[qtype]:
        scale = torch.rand(blocks.shape[0], 1, generator=gen) * 0.002 + 0.0005
        blocks[:, at : at + 2] = scale.half().view(torch.uint8)
    return blocks.reshape(n, -1)


def copies(t: torch.Tensor, span_bytes: int) -> itertools.cycle:
    """An endless cycle over enough copies of t to span span_bytes."""
    count = max(1, math.ceil(span_bytes / (t.numel() * t.element_size())))
    return itertools.cycle([t] + [t.clone() for _ in range(count - 1)])


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    return round(median_seconds(fn, repeats, warmup=warmup) * 1e3, 4)


def gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=[t.name for t in QuantType],
                   choices=[t.name for t in QuantType])  # fmt: skip
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    p.add_argument("--methods", action="store_true",
                   help="time every quant_gemm.Method (and the automatic pick) against "
                        "oneDNN over the prepacked float32 weight, per row count")  # fmt: skip
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--span-mib", type=int, default=256)
    p.add_argument("--no-dequantize", action="store_true", help="skip the reference path")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    types = [QuantType[name] for name in args.types]
    if not all(supported_natively(t) for t in types):
        print("error: the native CPU kernels did not load (see cuda_ext.build)", file=sys.stderr)
        return 2
    span = args.span_mib << 20
    gen = torch.Generator().manual_seed(0)
    if args.methods:
        return compare_methods(args, types, span, gen)
    results = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        weight = torch.randn(n, k, generator=gen) * 0.02
        floats = None  # rows -> (float32 ms, bfloat16 ms), timed on the first type's weight
        for qtype in types:
            blocks = weight_blocks(weight, qtype, gen)
            if floats is None:
                floats = time_floats(dequantize(blocks, qtype, k), args, span, gen)
            dequant_ms = None if args.no_dequantize else time_dequantize(blocks, qtype, k)
            for rows, ms in time_quantized(blocks, qtype, k, args, span, gen).items():
                f32_ms, bf16_ms = floats[rows]
                results.append({
                    "shape": shape, "n": n, "k": k, "type": qtype.name, "rows": rows,
                    "weight_bytes": blocks.numel(), "quant_ms": ms,
                    "quant_gbps": gbps(blocks.numel(), ms),
                    "f32_linear_ms": f32_ms, "f32_gbps": gbps(4 * n * k, f32_ms),
                    "bf16_linear_ms": bf16_ms, "bf16_gbps": gbps(2 * n * k, bf16_ms),
                    "f32_over_quant": round(f32_ms / ms, 2),
                    "bf16_over_quant": round(bf16_ms / ms, 2),
                    "dequantize_linear_ms": dequant_ms if rows == 1 else None,
                })  # fmt: skip
                print(
                    f"[quant_gemm] {shape} {qtype.name} M={rows}: {ms} ms "
                    f"({gbps(blocks.numel(), ms)} GB/s of weights); float32 linear {f32_ms} ms "
                    f"(x{f32_ms / ms:.2f}), bfloat16 {bf16_ms} ms (x{bf16_ms / ms:.2f})",
                    file=sys.stderr,
                )
    print_summary(results)
    from e2e import machine_info

    report = {"command": invocation(__file__), "machine": machine_info(),
              "threads": args.threads, "span_mib": args.span_mib, "results": results}  # fmt: skip
    write_report(report, args.out, lambda png: plot(report, png))
    return 0


def compare_methods(args, types: list[QuantType], span: int, gen) -> int:
    """Each Method's ms per shape, type and row count, beside oneDNN over the float32
    weight prepacked (what `--quantization none` runs) and `pick_method`'s choice."""
    onednn = packed_gemm_support(torch.float32) is None
    methods = [m for m in Method if onednn or m != Method.ONEDNN_PANELS]
    results = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        weight = torch.randn(n, k, generator=gen) * 0.02
        for qtype in types:
            blocks = weight_blocks(weight, qtype, gen)
            for rows, ms in time_methods(blocks, qtype, k, methods, args, span, gen).items():
                pick = pick_method(rows, k, onednn).name
                results.append({"shape": shape, "n": n, "k": k, "type": qtype.name,
                                "rows": rows, "ms": ms, "pick": pick})  # fmt: skip
                cells = "  ".join(f"{name} {t}" for name, t in ms.items())
                print(f"[quant_gemm] {shape} {qtype.name} M={rows}: {cells}; pick {pick}",
                      file=sys.stderr)  # fmt: skip
    from e2e import machine_info

    report = {"command": invocation(__file__), "machine": machine_info(), "onednn": onednn,
              "threads": args.threads, "span_mib": args.span_mib, "methods": results}  # fmt: skip
    write_report(report, args.out, lambda png: plot_methods(report, png))
    return 0


def time_methods(blocks, qtype: QuantType, k: int, methods, args, span: int, gen) -> dict:
    """rows -> {method name or "float32_prepacked": ms}, each call on another copy."""
    n = blocks.shape[0]
    weights = copies(blocks, span)
    floats = dequantize(blocks, qtype, k)
    packed = itertools.cycle(
        [PackedWeight(floats) for _ in range(max(1, math.ceil(span / (4 * n * k))))]
    )
    times = {}
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen)
        times[rows] = {
            m.name: median_ms(
                lambda x=x, m=m: quantized_matmul(x, next(weights), qtype, k, levels=m),
                args.repeats,
            )
            for m in methods
        }
        times[rows]["float32_prepacked"] = median_ms(
            lambda x=x: next(packed)(x, None), args.repeats
        )
    return times


def plot_methods(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["shape"], r["type"]) for r in report["methods"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4), squeeze=False)
    for ax, (shape, qtype) in zip(axes[0], cases, strict=True):
        rows = [r for r in report["methods"] if r["shape"] == shape and r["type"] == qtype]
        ms = [r["rows"] for r in rows]
        for name in rows[0]["ms"]:
            style = ":" if name == "float32_prepacked" else "-"
            ax.plot(ms, [r["ms"][name] / r["rows"] for r in rows], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("activation rows")
        ax.set_ylabel("ms per row")
        ax.set_title(f"{shape} {qtype}", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def time_quantized(
    blocks: torch.Tensor, qtype: QuantType, k: int, args, span: int, gen
) -> dict[int, float]:
    """rows -> ms of quantized_matmul, each call on another copy of the blocks."""
    weights = copies(blocks, span)
    times = {}
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen)
        times[rows] = median_ms(
            lambda x=x, w=weights: quantized_matmul(x, next(w), qtype, k), args.repeats
        )
    return times


def time_floats(weight: torch.Tensor, args, span: int, gen) -> dict[int, tuple[float, float]]:
    """rows -> (ms of float32 F.linear, ms of bfloat16 F.linear), copies cycled."""
    f32, bf16 = copies(weight, span), copies(weight.bfloat16(), span)
    times = {}
    for rows in args.rows:
        x = torch.randn(rows, weight.shape[1], generator=gen)
        xb = x.bfloat16()
        times[rows] = (
            median_ms(lambda x=x, w=f32: F.linear(x, next(w)), args.repeats),
            median_ms(lambda x=xb, w=bf16: F.linear(x, next(w)), args.repeats),
        )
    return times


def time_dequantize(blocks: torch.Tensor, qtype: QuantType, k: int) -> float:
    """ms of the reference path at M = 1: dequantize, then the float32 product."""
    x = torch.randn(1, k)
    return median_ms(lambda: reference_quantized_matmul(x, blocks, qtype, k), 2, warmup=1)


def print_summary(results: list[dict]) -> None:
    """Effective GB/s of weight bytes at M = 1, per type and shape (stderr)."""
    one = [r for r in results if r["rows"] == 1]
    if not one:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in one))
    print("\nM = 1: GB/s of weight bytes (float32 / bfloat16 linear's time over ours)",
          file=sys.stderr)  # fmt: skip
    for qtype in dict.fromkeys(r["type"] for r in one):
        cells = []
        for shape in shapes:
            r = next(r for r in one if r["type"] == qtype and r["shape"] == shape)
            cells.append(f"{r['quant_gbps']:6.1f} (x{r['f32_over_quant']}/x{r['bf16_over_quant']})")
        print(f"  {qtype:5} " + "  ".join(cells), file=sys.stderr)
    for shape in shapes:
        r = next(r for r in one if r["shape"] == shape)
        print(f"  {shape}: float32 linear {r['f32_gbps']} GB/s, bfloat16 {r['bf16_gbps']} GB/s",
              file=sys.stderr)  # fmt: skip


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    types = list(dict.fromkeys(r["type"] for r in results))
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    rows = sorted({r["rows"] for r in results})
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        one = {r["type"]: r for r in results if r["shape"] == shape and r["rows"] == min(rows)}
        xs = [j + i * width for j in range(len(types))]
        bw.bar(xs, [one[t]["quant_gbps"] for t in types], width, label=shape)
        first = next(iter(one.values()))
        for key, style in (("f32_gbps", ":"), ("bf16_gbps", "--")):
            bw.hlines(first[key], xs[0] - width / 2, xs[-1] + width / 2, colors=f"C{i}",
                      linestyles=style, linewidth=0.8)  # fmt: skip
    bw.set_xticks([j + 0.4 - width / 2 for j in range(len(types))], types)
    bw.set_ylabel(f"GB/s of weight bytes at M = {min(rows)}")
    bw.set_title("bars: quantized; dotted: float32 linear; dashed: bfloat16", fontsize=8)
    bw.legend(fontsize=7)
    width = 0.8 / len(rows)
    for i, m in enumerate(rows):
        values = []
        for t in types:  # geometric mean over the shapes
            picked = [r["bf16_over_quant"] for r in results if r["type"] == t and r["rows"] == m]
            values.append(math.prod(picked) ** (1 / len(picked)))
        ratio.bar([j + i * width for j in range(len(types))], values, width, label=f"M = {m}")
    ratio.axhline(1.0, color="black", linewidth=0.8)
    ratio.set_xticks([j + 0.4 - width / 2 for j in range(len(types))], types)
    ratio.set_ylabel("bfloat16 linear time / quantized time")
    ratio.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
