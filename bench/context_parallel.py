"""Context parallelism on this machine: one long prompt's prefill on one device against
two ranks sharing its tokens.

A random-weight Llama (`load_format="dummy"`, float32) prefills one `--prompt-len`-token
prompt in one step and decodes `--output-len` tokens, greedy; the tokens are checked
identical. Reported: the time to the first token (the prefill), decode tokens per
second, and the K/V the ranks gather per step (2 x layers x prompt tokens x KV heads x
head size x 4 bytes to each rank). On two cores each rank gets one, against both for one
device: the figure is the exchange's cost, not a speed-up.

    python bench/context_parallel.py --out bench/results/context_parallel.json
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

from pipeline_bubble import write_config  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run(model_dir: Path, cp: int, prompt: list[int], out_len: int) -> tuple[dict, list[int]]:
    with LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        context_parallel_size=cp,
        kv_cache_memory=256 << 20,
        max_model_len=len(prompt) + out_len + 16,
        max_num_batched_tokens=len(prompt) + 16,
        enable_prefix_caching=False,  # the second run computes the prompt again
    ) as llm:
        llm.generate([prompt[:64]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        total = time.perf_counter() - start
    row = dict(
        context_parallel_size=cp,
        ttft_s=round(ttft, 3),
        decode_tok_s=round((out_len - 1) / max(total - ttft, 1e-9), 1),
    )
    print(row, file=sys.stderr, flush=True)
    return row, list(out.outputs[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(a.prompt_len)]
    kv_heads, head_size = max(1, a.hidden // 256), 64
    rows, outputs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_config(Path(tmp), a.hidden, a.layers)
        for cp in (1, 2):
            row, tokens = run(Path(tmp), cp, prompt, a.output_len)
            rows.append(row)
            outputs.append(tokens)
    report = dict(
        command=invocation(__file__),
        machine=machine(),
        model=dict(hidden=a.hidden, layers=a.layers, dtype="float32", weights="dummy"),
        prompt_len=a.prompt_len,
        output_len=a.output_len,
        kv_gathered_bytes_per_prefill=2 * a.layers * a.prompt_len * kv_heads * head_size * 4,
        tokens_identical=outputs[0] == outputs[1],
        rows=rows,
        ttft_ratio=round(rows[1]["ttft_s"] / rows[0]["ttft_s"], 2),
    )
    write_report(report, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
