"""Pipeline parallelism's bubble on this machine: one device against two stages, the
stages' micro-batches from one to four.

A random-weight Llama (`load_format="dummy"`, float32; `--layers` layers of `--hidden`)
decodes `--num-prompts` prompts offline, greedy, with the same tokens out of every
configuration (checked). Each run reports output tokens per second and the last stage's
bubble: the share of the run rank 0 (the last stage, in this process) spent waiting for
the first stage's stream (`StageLink.waited_s`). GPipe's bubble for S stages and M
micro-batches, (S - 1) / (M + S - 1), is printed beside it. With two ranks on two cores,
each stage gets one core, against both for the one device.

    python bench/pipeline_bubble.py --out bench/results/pipeline_bubble.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from report import invocation, machine, write_report  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

CONFIGS = [(1, 1), (2, 1), (2, 2), (2, 4)]  # (stages, micro-batches)


def write_config(directory: Path, hidden: int, layers: int, **fields) -> None:
    """config.json of a float32 Llama `hidden` wide and `layers` deep (64-wide heads, a
    KV head per four; `fields` override, e.g. the vocabulary)."""
    from transformers import LlamaConfig

    LlamaConfig(
        **{
            "hidden_size": hidden,
            "intermediate_size": hidden * 8 // 3 // 64 * 64,
            "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64,
            "num_key_value_heads": max(1, hidden // 256),
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
            "architectures": ["LlamaForCausalLM"],
            "dtype": "float32",
            **fields,
        }
    ).save_pretrained(directory)


def run(model_dir: Path, stages: int, micro: int, prompts, out_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    with LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        pipeline_parallel_size=stages,
        pipeline_micro_batches=micro if stages > 1 else 0,
        kv_cache_memory=256 << 20,
        max_model_len=1024,
    ) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        link = getattr(llm.engine.worker, "worker", llm.engine.worker).runner.model.stage_link
        waited = getattr(link, "waited_s", 0.0)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        waited = getattr(link, "waited_s", 0.0) - waited
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    row = dict(
        stages=stages,
        micro_batches=micro,
        seconds=round(seconds, 2),
        output_tok_s=round(sum(map(len, tokens)) / seconds, 1),
        last_stage_waiting=round(waited / seconds, 3),
        gpipe_bubble=round((stages - 1) / (micro + stages - 1), 3),
    )
    print(row, file=sys.stderr, flush=True)
    return row, tokens


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{r['stages']} stage(s)\n{r['micro_batches']} part(s)" for r in rows]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.bar(labels, [r["output_tok_s"] for r in rows])
        a.set_ylabel("output tokens / s")
        b.bar(labels, [r["last_stage_waiting"] for r in rows], label="measured")
        b.plot(labels, [r["gpipe_bubble"] for r in rows], "ko--", label="(S-1)/(M+S-1)")
        b.set_ylabel("last stage's share of the run spent waiting")
        b.legend()
        fig.tight_layout()
        fig.savefig(path)

    return draw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    rows, outputs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_config(Path(tmp), a.hidden, a.layers)
        for stages, micro in CONFIGS:
            row, tokens = run(Path(tmp), stages, micro, prompts, a.output_len)
            rows.append(row)
            outputs.append(tokens)
    report = dict(
        command=invocation(__file__),
        machine=machine(),
        model=dict(hidden=a.hidden, layers=a.layers, dtype="float32", weights="dummy"),
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        tokens_identical=all(t == outputs[0] for t in outputs),
        rows=rows,
    )
    write_report(report, a.out, plot(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
