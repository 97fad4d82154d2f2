"""Fused native layer ops vs torch's, in the whole engine step.

`LLM`'s in-process engine (engine core, worker, sampler) decodes B sequences at context
`--context`; each step the worker's model alternates between the fused native layer ops
(residual add + RMSNorm, rotary, SiLU-and-mul: the default on CPU) and torch's, the same
weights over the same KV cache, so machine noise hits both alike. The figure is each
one's median step. Models: the 58M Llama of bench/systems.py, and a random-weight model
of SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads).

    python bench/layer_ops.py --out bench/results/layer_ops.json
    python bench/layer_ops.py --models 58m --dtypes float32 --batch 16 --steps 10   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402
from systems import MODEL_SHAPE, write_model  # noqa: E402

SMOLLM2_SHAPE = dict(
    MODEL_SHAPE,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SHAPES = {"58m": MODEL_SHAPE, "smollm2-shape": SMOLLM2_SHAPE}


def log(msg: str) -> None:
    print(f"[layer_ops] {msg}", file=sys.stderr, flush=True)


def torch_twin(runner, dtype: torch.dtype):
    """The worker's model rebuilt with torch's layer ops, sharing its weights' values."""
    from engine.worker.models.layer_ops import TORCH_LAYER_OPS

    fused = runner.model
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        config = runner.model_config.hf_config
        plain = type(fused)(config, runner.backend, layer_ops=TORCH_LAYER_OPS)
    finally:
        torch.set_default_dtype(previous)
    plain.load_state_dict(fused.state_dict())
    return plain.eval()


def step_times(model_dir: str, dtype: str, batch: int, context: int, steps: int) -> dict:
    """Median seconds of a decode step with each model, alternating step by step."""
    from engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
    )
    engine, runner = llm.engine, llm.engine.worker.runner
    models = {"fused": runner.model, "torch": torch_twin(runner, getattr(torch, dtype))}
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 40, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [3 + (i * 7 + j) % 30000 for j in range(context)], params)
    while engine.core.stats().num_waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.core.scheduler.running
    ):
        engine.step()
    times: dict[str, list[float]] = {"fused": [], "torch": []}
    for s in range(steps + 2):  # the first two warm both up
        for name in ("fused", "torch") if s % 2 == 0 else ("torch", "fused"):
            runner.model = models[name]
            start = time.perf_counter()
            engine.step()
            if s >= 2:
                times[name].append(time.perf_counter() - start)
    runner.model = models["fused"]
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    dtypes = ["float32", "bfloat16"]
    p.add_argument("--dtypes", nargs="+", choices=dtypes, default=dtypes)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="timed steps of each (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for model in a.models:
        with tempfile.TemporaryDirectory() as tmp:
            write_model(Path(tmp), seed=0, shape=SHAPES[model])
            for dtype in a.dtypes:
                for batch in a.batch:
                    t = step_times(tmp, dtype, batch, a.context, a.steps)
                    row = dict(
                        model=model,
                        dtype=dtype,
                        batch=batch,
                        torch_tok_s=round(batch / t["torch"], 1),
                        fused_tok_s=round(batch / t["fused"], 1),
                        speedup=round(t["torch"] / t["fused"], 3),
                    )
                    log(json.dumps(row))
                    rows.append(row)
    result = dict(
        command=invocation(__file__),
        context=a.context,
        steps=a.steps,
        threads=a.threads,
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['model']}\n{r['dtype'][:4]} b{r['batch']}" for r in result["rows"]]
    ax.bar(range(len(labels)), [r["speedup"] for r in result["rows"]])
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylabel("engine step speedup (torch / fused time)")
    ax.set_title("Fused native layer ops in the decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
