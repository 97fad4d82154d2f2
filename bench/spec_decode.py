"""Speculative decoding: output tokens per second with and without drafts, one run.

SmolLM2-135M-Instruct (the default model, or `--model`) answers chat requests offline,
`--batch` of them at a time (max_num_seqs), greedily, on two workloads:
  copy  requests that quote a text and ask for it back, edited or whole: ShareGPT
        passages to repeat, Alpaca inputs to rewrite, and a generated Python function
        (repeated identifiers) whose variable is to be renamed;
  free  Alpaca instructions with no input text (free writing: little to copy).
For each batch size and workload: the engine without speculation, then with each
`--configs` entry (ngram with k drafts, as `ngram:K` or `ngram:K:MIN:MAX`; a trailing
`:always` lifts the batch rule, which on a CPU lets drafts be verified only while one
sequence runs), each in a fresh engine after a warm-up. Reported per run: output tok/s, its ratio to
no speculation, acceptance rate, mean accepted length (tokens gained per verification),
and whether the greedy tokens equal those without speculation.

    python bench/spec_decode.py --out bench/results/spec_decode.json
    python bench/spec_decode.py --batch 1 --workloads copy --configs ngram:4 --num-prompts 4
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from peers.http_load import post_json, send_all  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

DATA = REPO.parent / "shared" / "data"
CODE = """def summarize_orders(orders, customers):
    totals_by_customer = {}
    for order in orders:
        customer_id = order["customer_id"]
        if customer_id not in totals_by_customer:
            totals_by_customer[customer_id] = 0
        totals_by_customer[customer_id] += order["amount"]
    report = []
    for customer_id, total in totals_by_customer.items():
        name = customers[customer_id]["name"]
        report.append((name, total))
    return sorted(report, key=lambda row: row[1], reverse=True)
"""


def log(msg: str) -> None:
    print(f"[spec_decode] {msg}", file=sys.stderr, flush=True)


def copy_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    """Requests whose answer mostly quotes their own text."""
    share = json.loads((DATA / "sharegpt_v3_filtered_1000.json").read_text())
    passages = [
        c["value"]
        for s in share
        for c in s["conversations"][:1]
        if c["from"] == "human" and 300 <= len(c["value"]) <= 900
    ]
    alpaca = json.loads((DATA / "alpaca_data_first1727.json").read_text())
    inputs = [a for a in alpaca if len(a["input"]) >= 120]
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = rng.choice(passages)
            ask = f"Repeat the following text exactly, word for word:\n\n{text}"
        elif kind == 1:
            a = rng.choice(inputs)
            ask = f"{a['instruction']} Quote the text first, then answer.\n\n{a['input']}"
        else:
            ask = f"Rename the variable `report` to `ranking` in this code:\n\n{CODE}"
        out.append([{"role": "user", "content": ask}])
    return out


def free_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    alpaca = json.loads((DATA / "alpaca_data_first1727.json").read_text())
    asks = [a["instruction"] for a in alpaca if not a["input"]]
    return [[{"role": "user", "content": ask}] for ask in rng.sample(asks, n)]


def parse_config(text: str, model: str) -> dict | None:
    """'ngram:K', 'ngram:K:MIN:MAX', 'draft:K' (the model drafting for itself: every
    greedy draft accepted, each costing a whole step) or 'draft:K:DIR', each optionally
    with ':always' (no batch rule)."""
    method, *parts = text.split(":")
    always = parts[-1:] == ["always"]
    numbers = parts[:-1] if always else parts
    if method == "draft" and len(numbers) in (1, 2):
        config = {"method": "draft_model", "num_speculative_tokens": int(numbers[0])}
        config["model"] = numbers[1] if len(numbers) == 2 else model
        return config | ({"disable_by_batch_size": 1 << 20} if always else {})
    if method != "ngram" or len(numbers) not in (1, 3):
        raise SystemExit(
            f"--configs: 'ngram:K[:MIN:MAX][:always]' or 'draft:K[:DIR]'; got {text!r}"
        )
    config = {"method": "ngram", "num_speculative_tokens": int(numbers[0])}
    if len(numbers) == 3:
        config |= {"prompt_lookup_min": int(numbers[1]), "prompt_lookup_max": int(numbers[2])}
    if always:
        config["disable_by_batch_size"] = 1 << 20
    return config


def run(model: str, prompts, batch: int, spec: dict | None, a) -> dict:
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    kwargs = dict(max_num_seqs=batch, seed=0, speculative_config=spec)
    kwargs["pipeline_depth"] = a.pipeline_depth
    if a.quantization:
        kwargs["quantization"] = a.quantization
    with LLM(model, **kwargs) as llm:
        llm.chat(prompts[:2], params.with_updates(max_tokens=32), use_tqdm=False)  # warm-up
        before = llm.stats()
        start = time.perf_counter()
        outs = llm.chat(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    generated = sum(len(t) for t in tokens)
    drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    proposed = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return dict(
        config=spec,
        seconds=round(seconds, 3),
        output_tokens=generated,
        output_tok_s=round(generated / seconds, 1),
        steps=stats.num_steps - before.num_steps,
        acceptance_rate=round(accepted / proposed, 3) if proposed else None,
        mean_accepted_length=round(1 + accepted / drafts, 3) if drafts else None,
        verifications=drafts,
        tokens=tokens,
    )


def run_served(model: str, prompts, batch: int, spec: dict | None, a) -> dict:
    """The same requests to `pagedserve serve` (its actors: the worker in its own process,
    planning `--pipeline-depth` ahead), `batch` at a time, all sent at once."""
    import urllib.request

    from web.launch import ServerProcess

    args = ["--model", model, "--max-num-seqs", str(batch), "--seed", "0"]
    args += ["--pipeline-depth", str(a.pipeline_depth)]
    args += ["--quantization", a.quantization] if a.quantization else []
    args += ["--speculative-config", json.dumps(spec)] if spec else []
    body = {"model": "m", "temperature": 0, "max_tokens": a.max_tokens}
    server = ServerProcess(args + ["--served-model-name", "m"])
    server.start(timeout=300)
    try:
        warm = {**body, "messages": prompts[0], "max_tokens": 32}
        post_json(server.port, "/v1/chat/completions", warm, timeout=300)
        load = send_all(
            server.port, "/v1/chat/completions", [{**body, "messages": p} for p in prompts]
        )
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as reply:
            metrics = reply.read().decode()
    finally:
        server.stop()
    if load.errors:
        raise RuntimeError(f"requests failed: {load.errors[:3]}")

    def total(name: str) -> float:
        lines = [ln for ln in metrics.splitlines() if ln.startswith(name + "{")]
        return sum(float(ln.split()[-1]) for ln in lines)

    drafts = total("vllm:spec_decode_num_drafts_total")
    proposed = total("vllm:spec_decode_num_draft_tokens_total")
    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    generated = sum(r["usage"]["completion_tokens"] for r in load.answers)
    return dict(
        config=spec,
        seconds=round(load.wall_s, 3),
        output_tokens=generated,
        output_tok_s=round(generated / load.wall_s, 1),
        steps=None,
        acceptance_rate=round(accepted / proposed, 3) if proposed else None,
        mean_accepted_length=round(1 + accepted / drafts, 3) if drafts else None,
        verifications=int(drafts),
        tokens=[r["choices"][0]["message"]["content"] for r in load.answers],
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = [r for r in rows if r["config"] is not None]
    labels = [f"{r['workload']} b{r['batch']}\n{r['label']}" for r in specs]
    fig, ax = plt.subplots(figsize=(max(6, len(specs) * 0.9), 4))
    ax.bar(range(len(specs)), [r["speedup"] for r in specs], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(specs)), labels, fontsize=7)
    ax.set_ylabel("output tok/s / no speculation")
    ax.set_title("Speculative decoding (prompt lookup), greedy, offline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (cached GGUF)")
    p.add_argument("--quantization", default=None, help="passed to LLM (default: the model's)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--workloads", nargs="+", choices=["copy", "free"], default=["copy", "free"])
    p.add_argument("--configs", nargs="+", default=["ngram:3:2:5", "ngram:3:2:5:always"])
    p.add_argument("--num-prompts", type=int, default=0, help="per run (0: 2 x batch, >= 12)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--pipeline-depth", type=int, default=1, choices=[1, 2], help="2: plan one step ahead"
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="through `pagedserve serve` (the warm-up and metrics come from the server)",
    )
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.model is None:
        from cuda_ext.build import cache_root
        from engine.default_model import resolve_default_model

        a.model = str(resolve_default_model(cache_root()))
    configs = [parse_config(c, a.model) for c in a.configs]
    rows = []
    for workload in a.workloads:
        for batch in a.batch:
            n = a.num_prompts or max(12, 2 * batch)
            rng = random.Random(batch)
            prompts = (copy_prompts if workload == "copy" else free_prompts)(n, rng)
            base = None
            for label, spec in [("none", None), *zip(a.configs, configs, strict=True)]:
                row = (run_served if a.served else run)(a.model, prompts, batch, spec, a)
                row |= dict(workload=workload, batch=batch, label=label, num_prompts=n)
                if base is None:
                    base = row
                row["speedup"] = round(row["output_tok_s"] / base["output_tok_s"], 3)
                row["tokens_identical"] = sum(
                    x == y for x, y in zip(row["tokens"], base["tokens"], strict=True)
                )
                log({k: v for k, v in row.items() if k != "tokens"})
                rows.append(row)
    for row in rows:
        del row["tokens"]
    result = dict(
        command=invocation(__file__),
        model=a.model,
        pipeline_depth=a.pipeline_depth,
        served=a.served,
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
