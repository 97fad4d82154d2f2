"""The KV cache in 8 bits (`--kv-cache-dtype int8 | fp8 | fp8_e5m2`) beside the float
cache, on the default model (SmolLM2-135M-Instruct, float32 weights), offline.

    python bench/kv_cache_dtype.py --out bench/results/kv_cache_dtype.json

(budget)   In --kv-cache-memory bytes: the blocks, how many sequences of --context
      tokens (and --output-len more) fit at once, and --requests such requests (random
      token ids) sent at once: the float cache runs fewer at a time; output tok/s.
(decode)   --batch sequences of --context random token ids decode --output-len tokens
      together in a cache of --decode-memory bytes (every dtype holds them): decode
      tok/s, the time of the run less that of one output token (the prompts come from
      the prefix cache in both).
(drift)    A --drift-tokens text (ShareGPT turns, joined) teacher-forced through each
      cache: every token's log-probability against the float cache's (mean and worst
      shift), and the mean log-likelihood.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import invocation, machine, write_report  # noqa: E402

DTYPES = ("auto", "int8", "fp8", "fp8_e5m2")


def log(msg: str) -> None:
    print(f"[kv_cache_dtype] {msg}", file=sys.stderr, flush=True)


def engine(args, kv_cache_dtype: str, **kwargs):
    from engine import LLM

    settings = dict(
        max_model_len=args.context + args.output_len + 16,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
    )
    return LLM(args.model, kv_cache_dtype=kv_cache_dtype, seed=0, **{**settings, **kwargs})


def timed_generate(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def random_prompts(args, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(args.context)] for _ in range(n)]


def part_decode(args, dtype: str) -> dict:
    """--batch sequences decoding together in a cache that holds them all. The prompts
    are computed once (prefix caching on), so the timed runs only decode: the time of
    --output-len + 1 tokens less that of 1 token (each after a prefix-cache hit)."""
    llm = engine(
        args,
        dtype,
        max_num_seqs=args.batch,
        kv_cache_memory=args.decode_memory,
        enable_prefix_caching=True,
    )
    prompts = random_prompts(args, args.batch, 1)
    timed_generate(llm, prompts, 1)  # computes and caches the prompts
    first_s, _ = timed_generate(llm, prompts, 1)
    total_s, tokens = timed_generate(llm, prompts, args.output_len + 1)
    return {
        "decode_tok_s": round((tokens - args.batch) / (total_s - first_s), 1),
        "first_token_s": round(first_s, 3),
    }


def part_budget(args, dtype: str) -> dict:
    """Capacity of --kv-cache-memory, and --requests requests run through it."""
    llm = engine(args, dtype, max_num_seqs=args.requests)
    stats = llm.stats()
    per_seq = -(-(args.context + args.output_len) // llm.config.cache.block_size)
    seconds, tokens = timed_generate(llm, random_prompts(args, args.requests, 2), args.output_len)
    return {
        "kv_cache_dtype": stats.kv_cache_dtype,
        "num_blocks": stats.num_blocks,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "sequences_that_fit": stats.num_blocks // per_seq,
        "output_tok_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 1),
        "preemptions": llm.stats().num_preemptions,
    }


def drift_text(args) -> str:
    data = json.loads((REPO.parent / "shared/data/sharegpt_v3_filtered_1000.json").read_text())
    texts = [t["value"] for item in data for t in item.get("conversations") or []]
    return "\n\n".join(texts)[: 8 * args.drift_tokens]


def part_drift(args, text: str, reference: list[float] | None, dtype: str) -> dict:
    from engine import SamplingParams

    llm = engine(args, dtype, max_model_len=args.drift_tokens + 8)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[: args.drift_tokens]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [out] = llm.generate([ids], params, use_tqdm=False)
    logprobs = [row[t].logprob for row, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    result = {"tokens": len(ids), "mean_loglik": round(sum(logprobs) / len(logprobs), 5)}
    if reference is not None:
        shifts = [abs(a - b) for a, b in zip(logprobs, reference, strict=True)]
        result["mean_shift"] = round(sum(shifts) / len(shifts), 5)
        result["max_shift"] = round(max(shifts), 4)
        result["last_quarter_mean_shift"] = round(
            sum(shifts[-len(shifts) // 4 :]) / (len(shifts) // 4), 5
        )
    return result, logprobs


def run(args) -> dict:
    report = {"command": invocation(__file__), "machine": machine(), "args": vars(args)}
    text = drift_text(args)
    reference = None
    for dtype in args.dtypes:
        log(f"{dtype}: capacity, and {args.requests} requests through it")
        row = part_budget(args, dtype)
        log(f"{dtype}: {args.batch} sequences decoding")
        row["decode"] = part_decode(args, dtype)
        log(f"{dtype}: drift over {args.drift_tokens} tokens")
        row["drift"], logprobs = part_drift(args, text, reference, dtype)
        reference = reference or logprobs
        report[dtype] = row
        log(json.dumps(row))
    base = report[args.dtypes[0]]
    for dtype in args.dtypes[1:]:
        row = report[dtype]
        row["vs_float"] = {
            "sequences_that_fit": ratio(row, base, "sequences_that_fit"),
            "decode_tok_s": ratio(row["decode"], base["decode"], "decode_tok_s"),
            "budget_output_tok_s": ratio(row, base, "output_tok_s"),
        }
    return report


def ratio(row: dict, base: dict, key: str) -> float:
    return round(row[key] / base[key], 2)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [d for d in DTYPES if d in report]
    names = [report[d]["kv_cache_dtype"] for d in dtypes]
    panels = [
        ("sequences that fit", lambda r: r["sequences_that_fit"]),
        ("decode tok/s (same batch)", lambda r: r["decode"]["decode_tok_s"]),
        ("output tok/s (same budget)", lambda r: r["output_tok_s"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.5))
    for ax, (title, value) in zip(axes, panels, strict=True):
        ax.bar(names, [value(report[d]) for d in dtypes], color="tab:blue")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20)
    a = report["args"]
    fig.suptitle(
        f"KV cache dtype, {a['context']}-token contexts, {a['kv_cache_memory'] >> 20} MiB cache",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--decode-memory", type=int, default=1 << 30, help="the decode part's cache")
    p.add_argument("--drift-tokens", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model is None:
        from cuda_ext.build import cache_root
        from engine.default_model import resolve_default_model

        args.model = str(resolve_default_model(cache_root()))
    if args.dtypes[0] != "auto":
        p.error("--dtypes must start with auto (the float cache the others are held to)")
    report = run(args)
    write_report(report, args.out, lambda path: plot(report, path))


if __name__ == "__main__":
    main()
