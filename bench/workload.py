"""Benchmark workloads: token-id prompts with input/output lengths from real data.

Everything comes from `../shared` (see `shared/data/SOURCES.md`):

- `sharegpt`: prompts are the first human turns of `data/sharegpt_v3_filtered_1000.json`
  (ShareGPT V3, vLLM-style filter). That file keeps no replies, so output lengths come
  from elsewhere: by default the token counts of randomly drawn Alpaca answers
  (`output_source="alpaca"`, mean ~60 tokens), or the Azure LLM conversation trace
  (`output_source="azure"`: `data/azure_llm_trace_2023_conv.csv`, column
  `num_decode_tokens`, mean ~220 tokens, about 4x the decode work).
- `alpaca`: prompts are `instruction` (+ "\\n" + `input` when present) of
  `data/alpaca_data_first1727.json`; output lengths are by default the token counts of
  the same record's `output` (real prompt/answer pairs), or the Azure trace.

Token ids are the real ids of the prompt text under the Llama 2 tokenizer
(`tokenizers/llama2/tokenizer.json`, vocab 32000), with its BOS (id 1) prepended.

Clipping to the context (`max_model_len`, 1024 for the bench model), in this order:
0. when `max_output` is given (the bench's --max-output-len, e.g. in --quick), longer
   outputs are cut to `max_output` tokens;
1. outputs are at least `min_output` tokens (default 4; a shorter real answer is raised);
2. a prompt longer than `max_model_len - min_output` tokens keeps its FIRST
   `max_model_len - min_output` tokens;
3. the output length becomes `min(output, max_model_len - input)`, so
   input + output <= max_model_len for every request.
`Workload.clipping` counts how many requests each rule touched.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("sharegpt", "alpaca")
OUTPUT_SOURCES = ("azure", "alpaca")
SHARED = Path(__file__).resolve().parents[2] / "shared"

_FILES = {
    "sharegpt": "data/sharegpt_v3_filtered_1000.json",
    "alpaca": "data/alpaca_data_first1727.json",
    "azure": "data/azure_llm_trace_2023_conv.csv",
    "mooncake": "data/mooncake_conversation_trace.jsonl",
    "tokenizer": "tokenizers/llama2/tokenizer.json",
}


class SharedDataMissing(RuntimeError):
    """../shared (data and tokenizer) is not there; the bench cannot build its workload."""


@dataclass(frozen=True)
class Workload:
    """Prompts (token-id lists) and the number of tokens to generate for each."""

    dataset: str
    output_source: str
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int
    max_model_len: int
    clipping: dict[str, int] = field(default_factory=dict)

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def summary(self) -> dict:
        """Sizes and percentiles of the lengths, for the JSON report."""
        ins, outs = self.input_lens, self.output_lens
        return {
            "dataset": self.dataset,
            "output_lengths_from": self.output_source,
            "num_prompts": len(self.prompts),
            "seed": self.seed,
            "max_model_len": self.max_model_len,
            "total_input_tokens": sum(ins),
            "total_output_tokens": sum(outs),
            "input_len": _percentiles(ins),
            "output_len": _percentiles(outs),
            "clipping": dict(self.clipping),
        }


def _percentiles(values: list[int]) -> dict[str, float]:
    s = sorted(values)

    def pct(p: float) -> int:
        return s[min(len(s) - 1, int(p / 100 * len(s)))]

    return {
        "mean": round(sum(s) / len(s), 1),
        "p50": pct(50),
        "p90": pct(90),
        "max": s[-1],
        "min": s[0],
    }


def shared_path(name: str, shared: Path = SHARED) -> Path:
    path = shared / _FILES[name]
    if not path.is_file():
        raise SharedDataMissing(
            f"{path} is missing: the offline benchmark draws its prompts and lengths from "
            f"../shared (data/ and tokenizers/llama2/); check out the shared folder next to "
            f"the repository (expected at {shared})"
        )
    return path


def load_tokenizer(shared: Path = SHARED):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(shared_path("tokenizer", shared)))


def _sharegpt_texts(shared: Path) -> list[str]:
    records = json.loads(shared_path("sharegpt", shared).read_text())
    texts = []
    for rec in records:
        turns = rec.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            texts.append(turns[0]["value"])
    return texts


def _alpaca_records(shared: Path) -> list[tuple[str, str]]:
    records = json.loads(shared_path("alpaca", shared).read_text())
    pairs = []
    for rec in records:
        prompt = rec["instruction"] + ("\n" + rec["input"] if rec.get("input") else "")
        if prompt.strip() and rec.get("output", "").strip():
            pairs.append((prompt, rec["output"]))
    return pairs


def _azure_output_lens(shared: Path) -> list[int]:
    with shared_path("azure", shared).open() as f:
        return [int(row["num_decode_tokens"]) for row in csv.DictReader(f)]


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]


def sample_workload(
    dataset: str = "sharegpt",
    num_prompts: int = 200,
    seed: int = 0,
    max_model_len: int = 1024,
    output_source: str | None = None,
    min_output: int = 4,
    max_output: int | None = None,
    shared: Path = SHARED,
) -> Workload:
    """Draws `num_prompts` requests (without replacement) reproducibly from `seed`."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    output_source = output_source or "alpaca"
    if output_source not in OUTPUT_SOURCES:
        raise ValueError(f"output_source must be one of {OUTPUT_SOURCES}, got {output_source!r}")
    rng = random.Random(seed)
    tok = load_tokenizer(shared)
    if dataset == "sharegpt":
        texts = _sharegpt_texts(shared)
        chosen = _choose(rng, len(texts), num_prompts, "ShareGPT prompts")
        prompts = _encode(tok, [texts[i] for i in chosen])
        paired_outputs = None
    else:
        pairs = _alpaca_records(shared)
        chosen = _choose(rng, len(pairs), num_prompts, "Alpaca records")
        prompts = _encode(tok, [pairs[i][0] for i in chosen])
        paired_outputs = [pairs[i][1] for i in chosen]
    if output_source == "azure":
        trace = _azure_output_lens(shared)
        outs = [trace[rng.randrange(len(trace))] for _ in range(num_prompts)]
    elif paired_outputs is not None:  # alpaca prompts, their own answers
        outs = [len(e.ids) for e in tok.encode_batch(paired_outputs, add_special_tokens=False)]
    else:  # sharegpt prompts, output lengths of random Alpaca answers
        answers = [a for _, a in _alpaca_records(shared)]
        picked = [answers[rng.randrange(len(answers))] for _ in range(num_prompts)]
        outs = [len(e.ids) for e in tok.encode_batch(picked, add_special_tokens=False)]
    prompts, outs, clipping = clip_to_context(prompts, outs, max_model_len, min_output, max_output)
    return Workload(dataset, output_source, prompts, outs, seed, max_model_len, clipping)


def _choose(rng: random.Random, available: int, wanted: int, what: str) -> list[int]:
    if wanted < 1:
        raise ValueError(f"num_prompts must be >= 1, got {wanted}")
    if wanted > available:
        raise ValueError(f"asked for {wanted} prompts but only {available} {what} exist")
    return rng.sample(range(available), wanted)


def clip_to_context(
    prompts: list[list[int]],
    outs: list[int],
    max_model_len: int,
    min_output: int = 4,
    max_output: int | None = None,
) -> tuple[list[list[int]], list[int], dict[str, int]]:
    """Applies the clipping rules of the module docstring; returns counts per rule."""
    if not 1 <= min_output < max_model_len:
        raise ValueError(f"min_output must be in [1, {max_model_len}), got {min_output}")
    max_input = max_model_len - min_output
    if max_output is not None and max_output < min_output:
        raise ValueError(f"max_output ({max_output}) must be >= min_output ({min_output})")
    clipping = dict.fromkeys(
        (
            "output_capped_to_max_output",
            "output_raised_to_min",
            "input_truncated",
            "output_clipped_to_context",
        ),
        0,
    )
    new_prompts, new_outs = [], []
    for ids, out in zip(prompts, outs, strict=True):
        if max_output is not None and out > max_output:
            out = max_output
            clipping["output_capped_to_max_output"] += 1
        if out < min_output:
            out = min_output
            clipping["output_raised_to_min"] += 1
        if len(ids) > max_input:
            ids = ids[:max_input]
            clipping["input_truncated"] += 1
        if len(ids) + out > max_model_len:
            out = max_model_len - len(ids)
            clipping["output_clipped_to_context"] += 1
        new_prompts.append(list(ids))
        new_outs.append(out)
    return new_prompts, new_outs, clipping
