"""Offline throughput: our engine vs Hugging Face transformers, same model, same run.

    python bench/offline_throughput.py --num-prompts 200 --dataset sharegpt \
        --out bench/results/offline_throughput.json
    python bench/offline_throughput.py --quick          # smoke test, < 2 minutes

Systems (each in its own subprocess, so peak RSS is per system; the same torch thread
count in all of them):
  ours        `LLM.generate(prompts, params_list)`: paged KV cache, continuous batching.
  hf_static   `model.generate` over FIFO batches of B prompts (left padding, attention
              mask); one subprocess per B in --hf-batch-sizes. A batch runs to its longest
              requested output; only each request's own output tokens are counted.
  hf_cb       transformers' continuous batching (`generate_batch`'s manager): requests are
              added one by one with their own `max_new_tokens` (generate_batch itself only
              takes one max_new_tokens for all prompts).
A reference subprocess also runs HF `generate` unbatched on a few prompts to check that
our greedy tokens equal HF's.

The model is a dummy-weight Llama (~58M parameters): HF's `LlamaForCausalLM(config)`
seeded init, saved to model.safetensors in a temp dir that every system loads, so all
see identical weights. See bench/README.md for what each number means.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from bench_args import parse_args  # noqa: E402
from systems import (  # noqa: E402
    BLOCK_SIZE,
    MODEL_SHAPE,
    child_main,
    default_kv_cache_memory,
    log,
    write_model,
)
from workload import SharedDataMissing, sample_workload  # noqa: E402

# ---------------------------------------------------------------------------- parent


def spawn(args, system: str, workdir: Path, batch_size: int | None = None) -> dict:
    tag = system if batch_size is None else f"{system}_b{batch_size}"
    result_file = workdir / f"{tag}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--system",
        system,
        "--workdir",
        str(workdir),
        "--result-file",
        str(result_file),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--hf-cb-page-size",
        str(args.hf_cb_page_size),
        "--hf-cb-max-requests",
        str(args.hf_cb_max_requests),
        "--hf-cb-max-batch-tokens",
        str(args.hf_cb_max_batch_tokens),
        "--check-requests",
        str(args.check_requests),
        "--check-tokens",
        str(args.check_tokens),
    ]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        MKL_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
    )
    log(f"running {tag} ...")
    load_before = _loadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tail = bytearray()
    while chunk := proc.stderr.read1(65536):  # pass progress through, keep the tail
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        tail = (tail + chunk)[-16384:]
    returncode = proc.wait()
    elapsed = time.perf_counter() - t0
    if returncode != 0 or not result_file.is_file():
        lines = tail.decode(errors="replace").replace("\r", "\n").strip().splitlines()[-15:]
        log(f"{tag} FAILED (exit {returncode})")
        return {"result": {"error": "\n".join(lines), "exit_code": returncode}, "tokens": None}
    data = json.loads(result_file.read_text())
    data["result"].update(
        process_wall_s=round(elapsed, 1), load_avg_before=load_before, load_avg_after=_loadavg()
    )
    r = data["result"]
    if "output_tokens_per_s" in r:
        log(
            f"{tag}: {r['output_tokens_per_s']} output tok/s, {r['requests_per_s']} req/s, "
            f"wall {r['wall_s']}s, peak RSS {r['peak_rss_mib']} MiB"
        )
    else:
        log(f"{tag}: done in {elapsed:.1f}s")
    return data


def compare_tokens(ours: list[list[int]] | None, other: list[list[int]] | None) -> dict | None:
    """Exact-match count and mean common-prefix fraction of two systems' outputs."""
    if not ours or not other:
        return None
    exact, frac, first_div = 0, 0.0, []
    for a, b in zip(ours, other, strict=True):
        pos = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        n = next(pos, min(len(a), len(b)))
        exact += a == b
        frac += n / max(len(a), 1)
        if a != b:
            first_div.append(n)
    return {
        "requests": len(other),
        "exact_matches": exact,
        "mismatches": len(other) - exact,
        "mean_common_prefix_fraction": round(frac / len(other), 4),
        "first_divergence_positions": first_div[:20],
    }


def reference_check(ours_tokens, ref) -> dict | None:
    if not ours_tokens or not ref.get("tokens"):
        return {"error": ref["result"].get("error", "no tokens")}
    ref_tokens = ref["tokens"]
    mismatched = [i for i, r in enumerate(ref_tokens) if ours_tokens[i][: len(r)] != r]
    return {
        "requests_checked": len(ref_tokens),
        "tokens_per_request": max(map(len, ref_tokens)),
        "mismatches": len(mismatched),
        "mismatched_requests": mismatched,
        "against": "HF generate, batch 1, no padding, greedy",
    }


def summarize(results: dict) -> dict:
    ours = results.get("ours", {}).get("result", {})
    statics = {k: v["result"] for k, v in results.items() if k.startswith("hf_static")}
    ok_statics = {k: v for k, v in statics.items() if "error" not in v}
    best = max(ok_statics, key=lambda k: ok_statics[k]["output_tokens_per_s"], default=None)
    cb = results.get("hf_cb", {}).get("result", {})
    out = {"hf_static_best": best}

    def ratio(a, b, key):
        return round(a[key] / b[key], 3) if key in a and key in b and b[key] else None

    for key in ("output_tokens_per_s", "requests_per_s"):
        if best is not None:
            out[f"ours_over_hf_static_best_{key}"] = ratio(ours, ok_statics[best], key)
        out[f"ours_over_hf_cb_{key}"] = ratio(ours, cb, key)
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, tput, rss = [], [], []
    for name, r in report["systems"].items():
        if "output_tokens_per_s" in r:
            label = name.replace("hf_static_b", "HF static\nB=")
            names.append(label.replace("hf_cb", "HF cont.\nbatching"))
            tput.append(r["output_tokens_per_s"])
            rss.append(r["peak_rss_mib"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:green" if n == "ours" else "tab:blue" for n in names]
    for ax, values, label in ((axes[0], tput, "output tokens/s"), (axes[1], rss, "peak RSS (MiB)")):
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)
    c, w = report["config"], report["workload"]
    fig.suptitle(
        f"Offline throughput, {w['num_prompts']} {w['dataset']} prompts, "
        f"{c['model']['num_params'] / 1e6:.0f}M Llama, {c['dtype']}, "
        f"{c['torch_threads']} CPU threads",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.system:
        child_main(args)
        return 0
    try:
        wl = sample_workload(
            args.dataset,
            args.num_prompts,
            args.seed,
            MODEL_SHAPE["max_position_embeddings"],
            args.output_lengths,
            max_output=args.max_output_len,
        )
    except SharedDataMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch
    import transformers

    if args.kv_cache_memory is None:
        args.kv_cache_memory = default_kv_cache_memory(
            wl.input_lens, wl.output_lens, args.max_num_seqs, args.dtype
        )
    results: dict[str, dict] = {}
    started, load_at_start = time.time(), _loadavg()
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        workdir = Path(tmp)
        num_params = write_model(workdir, args.seed)
        (workdir / "workload.json").write_text(
            json.dumps({"prompts": wl.prompts, "output_lens": wl.output_lens})
        )
        log(f"workload: {json.dumps(wl.summary())}")
        for system in args.systems:
            if system == "hf_static":
                for bs in args.hf_batch_sizes:
                    results[f"hf_static_b{bs}"] = spawn(args, system, workdir, bs)
            else:
                results[system] = spawn(args, system, workdir)
        if args.check_requests > 0 and "ours" in results:
            results["hf_reference"] = spawn(args, "hf_reference", workdir)
    ours_tokens = results.get("ours", {}).get("tokens")
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
        "config": {
            "model": {
                **{k: v for k, v in MODEL_SHAPE.items() if v is not None},
                "architecture": "LlamaForCausalLM",
                "num_params": num_params,
                "weights": f"HF LlamaForCausalLM init, torch.manual_seed({args.seed}), "
                "saved as float32 safetensors, loaded by every system",
            },
            "dtype": args.dtype,
            "torch_threads": args.threads,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_avg_at_start": load_at_start,
            "quick": args.quick,
            "seed": args.seed,
            "ours": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_memory_bytes": args.kv_cache_memory,
                "block_size": BLOCK_SIZE,
                "attention_backend": "auto (sdpa)",
            },
            "hf_static_batch_sizes": args.hf_batch_sizes,
            "hf_cb": {
                "page_size": args.hf_cb_page_size,
                "kv_cache_memory_bytes": args.kv_cache_memory,
                "max_batch_tokens": args.hf_cb_max_batch_tokens,
                "max_requests_per_batch": args.hf_cb_max_requests,
            },
        },
        "workload": wl.summary(),
        "systems": {k: v["result"] for k, v in results.items() if k != "hf_reference"},
        "summary": summarize(results),
        "correctness": {
            "ours_vs_hf_reference": reference_check(ours_tokens, results["hf_reference"])
            if "hf_reference" in results
            else None,
            **{
                f"ours_vs_{k}": compare_tokens(ours_tokens, v.get("tokens"))
                for k, v in results.items()
                if k not in ("ours", "hf_reference")
            },
        },
        "load_avg_at_end": _loadavg(),
        "total_bench_wall_s": round(time.time() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        plot(report, png)
        log(f"wrote {png}")
    brief = {"summary": report["summary"], "correctness": report["correctness"]}
    print(json.dumps(brief, indent=2))
    return 0


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
