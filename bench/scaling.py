"""Scaling out on one machine: tensor parallelism 1 vs 2, the cost of its collectives,
and data parallelism 1 vs 2.

    python bench/scaling.py --out bench/results/scaling.json

1. `tp`: offline `LLM.generate` output tok/s of the ~58M Llama shape `offline_throughput`
   uses (dummy weights; token-id prompts) with tensor_parallel_size 1 and 2. On a
   2-core CPU TP cannot speed anything up (two ranks share the same two cores and add
   two all-reduces per layer): the figure is the price of the collectives, and the test
   suite checks TP's correctness (tests/engine/test_tensor_parallel.py).
2. `all_reduce`: two gloo ranks all-reduce a [tokens, hidden] float32 tensor (the
   shape every row-parallel layer reduces) and all-gather a [rows, vocab / 2] one (the LM
   head); median microseconds per call, and per decode step of the model above
   (2 all-reduces per layer + 1 for the embedding, 1 all-gather).
3. `dp`: DP = 1 (one engine), and a ReplicaSet of 2 against two separate engines given
   half the requests each (`bench/scaling_dp.run_dp`), on the same 58M Llama shape with
   `--dp-requests` requests of `--max-tokens` tokens, `--dp-repeats` times (each run's
   figures kept, the median ratio reported); the target is a ratio >= 0.9.

Writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.systems import MODEL_SHAPE  # noqa: E402
from bench.timing import median_seconds  # noqa: E402

TOKENS = (1, 8, 64, 256)


def _model_dir(root: Path) -> str:
    from transformers import LlamaConfig

    LlamaConfig(**MODEL_SHAPE, architectures=["LlamaForCausalLM"]).save_pretrained(root)
    return str(root)


def run_tp(model_dir: str, num_requests: int, max_tokens: int) -> list[dict]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = [[1, 100 + i, 200 + i, 300 + i, 400 + i] for i in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for tp in (1, 2):
        kwargs = dict(load_format="dummy", skip_tokenizer_init=True, kv_cache_memory=512 << 20)
        with LLM(model_dir, tensor_parallel_size=tp, **kwargs) as llm:
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"tensor_parallel_size": tp, "output_tok_s": tokens / elapsed})
        print(f"[scaling] TP={tp}: {tokens / elapsed:.1f} output tok/s", file=sys.stderr)
    return rows


def _collective_rank(rank: int, init: str, results) -> None:
    import torch

    from engine.worker.parallel.group import TensorParallelGroup

    torch.set_num_threads(1)
    group = TensorParallelGroup.initialize(rank, 2, init, "gloo")
    hidden, vocab = MODEL_SHAPE["hidden_size"], MODEL_SHAPE["vocab_size"]
    out = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden)
        logits = torch.randn(min(tokens, 64), vocab // 2)
        out[tokens] = (
            _median_us(lambda x=x: group.all_reduce(x)),
            _median_us(lambda lg=logits: group.all_gather(lg)),
        )
    results.put((rank, out))
    group.leave()


def _median_us(fn, repeats: int = 50) -> float:
    return median_seconds(fn, repeats) * 1e6


def run_collectives() -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_collective_rank, args=(r, init, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
    per_layer = 2 * MODEL_SHAPE["num_hidden_layers"] + 1
    rows = []
    for tokens in TOKENS:
        reduce_us, gather_us = got[0][tokens]
        rows.append(
            {
                "tokens": tokens,
                "all_reduce_us": reduce_us,
                "lm_head_all_gather_us": gather_us,
                "per_step_ms": (per_layer * reduce_us + gather_us) / 1e3,
            }
        )
    return rows


def run_dp_repeated(model_dir: str, num_requests: int, max_tokens: int, repeats: int) -> dict:
    """`run_dp` `repeats` times on the 58M shape (dummy weights, token-id prompts)."""
    from bench.scaling_dp import run_dp

    kwargs = dict(load_format="dummy", skip_tokenizer_init=True, kv_cache_memory=512 << 20)
    runs = [run_dp(model_dir, num_requests, max_tokens, kwargs) for _ in range(repeats)]
    for run in runs:
        run["model"] = "58M Llama shape (dummy weights)"
    return {"runs": runs, "median_ratio": statistics.median(r["ratio"] for r in runs)}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    a.bar(
        [f"TP={r['tensor_parallel_size']}" for r in report["tp"]],
        [r["output_tok_s"] for r in report["tp"]],
    )
    a.set_title("offline output tok/s (58M Llama)")
    b.plot(
        [r["tokens"] for r in report["collectives"]],
        [r["per_step_ms"] for r in report["collectives"]],
        marker="o",
    )
    b.set_xscale("log")
    b.set_xlabel("tokens in the step")
    b.set_title("collectives per step, TP=2 (ms)")
    dp = report["dp"]
    best = min(dp["runs"], key=lambda r: abs(r["ratio"] - dp["median_ratio"]))
    c.bar(
        ["DP=1", "ReplicaSet\nof 2", "2 separate\nengines"],
        [best["one_engine_tok_s"], best["replica_set_tok_s"], best["separate_engines_tok_s"]],
    )
    c.set_title(f"output tok/s (median DP=2 ratio {dp['median_ratio']:.2f})")
    fig.suptitle(report["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/scaling.json")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dp-requests", type=int, default=128)
    p.add_argument("--dp-repeats", type=int, default=3)
    ns = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp))
        report = {
            "command": "python bench/scaling.py " + " ".join(argv or sys.argv[1:]),
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": multiprocessing.cpu_count(),
            },
            "tp": run_tp(model_dir, ns.num_requests, ns.max_tokens),
            "collectives": run_collectives(),
            "dp": run_dp_repeated(model_dir, ns.dp_requests, ns.max_tokens, ns.dp_repeats),
        }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
