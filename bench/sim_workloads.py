"""The simulator's workloads: request lengths from ../shared/data, and the traces
`bench/simulate.py` runs at a request rate.

- `sharegpt`: ShareGPT V3 prompts with output lengths from the Azure conversation trace
  (the ShareGPT files here keep no replies); `alpaca`: Alpaca prompts with their own
  answers (lengths under the Llama 2 tokenizer, `bench/workload.py`).
- `sharegpt-paper-lengths`: the same requests with prompt and output lengths scaled so
  their means are the paper's (161 and 338 tokens; its ShareGPT kept the replies), for
  the gap its longer outputs make.
- `mooncake`: the Mooncake conversation trace replayed, its 512-token prefix hashes
  becoming equal token runs (for prefix caching).
- `prefix-1shot`, `prefix-5shot` (paper Fig. 16): every prompt starts with the same
  80- or 341-token few-shot prefix, as the paper's WMT16 translation prompts do; the
  WMT16 sentences are not here, so each request's own sentence has an Alpaca prompt's
  length and its translation the same length.
- `chatbot` (paper Fig. 17): the Azure conversation trace's lengths (each prompt holds
  the chat history), the prompt cut to its last 1,024 tokens and the output to 1,024, as
  the paper does with ShareGPT conversations (none with their replies are here).
"""

from __future__ import annotations

import csv
import dataclasses
import json

from engine.sim.trace import TraceRequest, poisson_trace, replayed_trace, with_shared_prefix

WORKLOADS = (
    "sharegpt",
    "sharegpt-paper-lengths",
    "alpaca",
    "mooncake",
    "prefix-1shot",
    "prefix-5shot",
    "chatbot",
)
PAPER_SHAREGPT_MEANS = (161.31, 337.99)  # the paper's Fig. 11: prompt, output tokens
PREFIX_LENS = {"prefix-1shot": 80, "prefix-5shot": 341}  # the paper's few-shot prefixes
CHAT_WINDOW = 1024  # chatbot: the last tokens of the history kept, and the output cap


def workload_lengths(workload: str, mooncake_requests: int = 3000, max_model_len: int = 2048):
    """What `make_trace` draws from: (prompt_len, output_len) pairs, or for `mooncake`
    the first `mooncake_requests` records (arrival s, prompt len, output len, hashes)."""
    from bench.workload import sample_workload

    def pairs(workload) -> list[tuple[int, int]]:
        return [(len(p), o) for p, o in zip(workload.prompts, workload.output_lens, strict=True)]

    if workload == "sharegpt":
        return pairs(
            sample_workload("sharegpt", 1000, max_model_len=max_model_len, output_source="azure")
        )
    if workload == "sharegpt-paper-lengths":
        sharegpt = workload_lengths("sharegpt", max_model_len=max_model_len)
        return scaled_to_means(sharegpt, PAPER_SHAREGPT_MEANS)
    if workload == "alpaca":
        return pairs(sample_workload("alpaca", 1700, max_model_len=max_model_len))
    if workload in PREFIX_LENS:  # a translation is about as long as its sentence
        alpaca = sample_workload("alpaca", 1700, max_model_len=max_model_len)
        return [(len(p), len(p)) for p in alpaca.prompts]
    if workload == "chatbot":
        return chatbot_lengths()
    if workload == "mooncake":
        return mooncake_records(mooncake_requests)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


def scaled_to_means(
    lengths: list[tuple[int, int]], means: tuple[float, float]
) -> list[tuple[int, int]]:
    """`lengths` with prompts and outputs each scaled (rounded, at least 1) so their
    means are `means`."""
    prompt_scale = means[0] * len(lengths) / sum(p for p, _ in lengths)
    output_scale = means[1] * len(lengths) / sum(o for _, o in lengths)
    return [(max(1, round(p * prompt_scale)), max(1, round(o * output_scale))) for p, o in lengths]


def chatbot_lengths() -> list[tuple[int, int]]:
    """The Azure conversation trace's (prompt, output) lengths, each cut to CHAT_WINDOW."""
    from bench.workload import shared_path

    with shared_path("azure").open() as f:
        rows = list(csv.DictReader(f))
    pairs = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in rows]
    return [(min(p, CHAT_WINDOW), min(o, CHAT_WINDOW)) for p, o in pairs if p > 0 and o > 0]


def mooncake_records(limit: int) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """The Mooncake conversation trace's first `limit` requests: (arrival s, prompt
    len, output len, 512-token prefix hashes)."""
    from bench.workload import shared_path

    records = []
    with open(shared_path("mooncake")) as f:
        for line in f:
            row = json.loads(line)
            hashes = tuple(row["hash_ids"])
            records.append(
                (row["timestamp"] / 1000, row["input_length"], row["output_length"], hashes)
            )
            if len(records) == limit:
                break
    return records


def make_trace(
    workload: str,
    lengths,
    rate: float,
    duration_s: float,
    *,
    seed: int = 0,
    n: int = 1,
    beam_width: int = 0,
    max_model_len: int = 2048,
) -> list[TraceRequest]:
    """Poisson arrivals at `rate` req/s over `duration_s` of the workload's lengths (with
    its shared prefix), or the Mooncake trace replayed fast enough to average `rate`.
    `n` > 1: parallel samples per request; `beam_width` > 0: beam search instead."""
    if workload == "mooncake":
        native = len(lengths) / (lengths[-1][0] - lengths[0][0])
        return replayed_trace(lengths, rate / native, max_model_len)
    prefix = PREFIX_LENS.get(workload, 0)
    count = int(rate * duration_s)
    trace = poisson_trace(lengths, rate, count, seed, max_model_len - prefix)
    if prefix:
        trace = with_shared_prefix(trace, prefix)
    if beam_width:
        return [dataclasses.replace(r, n=beam_width, use_beam_search=True) for r in trace]
    return [dataclasses.replace(r, n=n) for r in trace] if n > 1 else trace


def mean_lengths(workload: str, lengths) -> tuple[float, float]:
    """Mean prompt and output lengths of the workload's requests (before clipping; the
    shared prefix included)."""
    if workload == "mooncake":
        prompts, outputs = [r[1] for r in lengths], [r[2] for r in lengths]
    else:
        prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    prefix = PREFIX_LENS.get(workload, 0)
    return prefix + sum(prompts) / len(prompts), sum(outputs) / len(outputs)
