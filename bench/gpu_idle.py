"""How much of a decode run leaves the GPU idle: the gaps between the device's kernels.

A random Llama of 1.2B parameters (bench/gpu_e2e.py's, bfloat16) decodes `--batch`
sequences offline with our kernels, in step and one step ahead. torch's profiler records
every kernel, copy and fill on the device during one timed `generate`; their union over
the span from the first to the last is the busy time, the rest is idle. Gaps longer than
`--step-gap-us` are counted apart: those are the host's turn between steps (planning,
input preparation, sampling's copy back), the short ones are launch gaps inside a step.
The offline engine plans and executes in one thread, so one step ahead here only moves
planning; the served engine overlaps it with execution in another process. `--modes`
compares ways of running a step: `eager` (host-built inputs, no graphs), `device`
(inputs built on the device), `graphs` (device inputs and piecewise CUDA graphs),
`triton` (graphs with the Triton attention kernels); each mode's tokens are compared
with the first mode's.

    python bench/gpu_idle.py --out bench/results/gpu_idle.json
    python bench/gpu_idle.py --modes eager graphs --depths 1 --out /tmp/idle.json
    python bench/gpu_idle.py --device cpu --batch 4 --output-len 8   # a dry run of the code
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MODES = {  # how a step runs: engine settings on top of the bench's own
    "eager": dict(enforce_eager=True, input_preparation="host"),
    "device": dict(enforce_eager=True, input_preparation="device"),
    "graphs": dict(input_preparation="device", cudagraph_capture_sizes=GRAPH_SIZES),
    "triton": dict(
        input_preparation="device", cudagraph_capture_sizes=GRAPH_SIZES, attention_backend="triton"
    ),
}


def log(msg: str) -> None:
    print(f"[gpu_idle] {msg}", file=sys.stderr, flush=True)


def intervals(trace: dict, categories: set[str]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of the trace's events in `categories`, sorted."""
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in categories
    ]
    return sorted(spans)


def top_kernels(trace: dict, steps: int, count: int = 15) -> list[dict]:
    """The kernels launched most often: launches and device microseconds per step."""
    calls, micros = Counter(), Counter()
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            calls[e["name"]] += 1
            micros[e["name"]] += float(e.get("dur", 0))
    return [
        dict(
            kernel=name[:120],
            per_step=round(n / steps, 1),
            us_per_step=round(micros[name] / steps, 1),
        )
        for name, n in calls.most_common(count)
    ]


def idle_summary(spans: list[tuple[float, float]], step_gap_us: float) -> dict:
    """Busy time as the union of `spans`; the gaps between them, long ones apart."""
    if not spans:
        return dict(events=0)
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = max(e for _, e in spans) - spans[0][0]
    long_gaps = [g for g in gaps if g > step_gap_us]
    return dict(
        events=len(spans),
        span_ms=round(span / 1e3, 2),
        busy_ms=round(busy / 1e3, 2),
        idle_share=round(1 - busy / span, 4) if span else 0.0,
        long_gaps=len(long_gaps),
        long_gap_ms=round(sum(long_gaps) / 1e3, 2),
        long_gap_share=round(sum(long_gaps) / span, 4) if span else 0.0,
        median_long_gap_us=round(sorted(long_gaps)[len(long_gaps) // 2], 1) if long_gaps else 0,
    )


def profile_run(path: str, device: str, prompts, out_len: int, depth: int, gap_us: float, mode):
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    kwargs = dict(device=device, skip_tokenizer_init=True, max_num_seqs=len(prompts))
    if device == "cuda":
        kwargs |= dict(dtype="bfloat16", gpu_memory_utilization=0.3, attention_backend="native")
    kwargs |= MODES[mode]
    activity = torch.profiler.ProfilerActivity
    activities = [activity.CUDA] if device == "cuda" else [activity.CPU]
    categories = DEVICE_CATEGORIES if device == "cuda" else {"cpu_op"}
    with LLM(path, pipeline_depth=depth, **kwargs) as llm:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (compile, capture): same shapes
        warmup = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        graphs = llm.engine.worker.runner.graphs
        replays = sum(p.num_replays for p in graphs.pieces) if graphs else 0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    row = dict(mode=mode, pipeline_depth=depth, batch=len(prompts), output_len=out_len)
    row |= dict(seconds=round(seconds, 3), step_ms=round(seconds * 1e3 / out_len, 2))
    row |= dict(warmup_s=round(warmup, 1), graph_replays=replays)
    row |= idle_summary(intervals(trace, categories), gap_us)
    row["top_kernels"] = top_kernels(trace, out_len)
    log(str({k: v for k, v in row.items() if k != "top_kernels"}))
    return row, [o.outputs[0].token_ids for o in outputs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--step-gap-us", type=float, default=50.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", nargs="+", default=["eager"], choices=sorted(MODES))
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if a.device == "cuda":
            from gpu_e2e import LLAMA_1B, random_llama

            random_llama(Path(tmp))
            vocab = LLAMA_1B["vocab_size"]
        else:
            from tests.engine.tiny_models import VOCAB, save_hf_model

            save_hf_model("llama", Path(tmp))
            vocab = VOCAB
        for batch in a.batch:
            prompts = [[rng.randrange(3, vocab) for _ in range(a.input_len)] for _ in range(batch)]
            first = None
            for mode in a.modes:
                for depth in a.depths:
                    row, tokens = profile_run(
                        tmp, a.device, prompts, a.output_len, depth, a.step_gap_us, mode
                    )
                    first = first or tokens
                    same = sum(x == y for x, y in zip(tokens, first, strict=True))
                    row["same_tokens_as_first"] = same
                    rows.append(row)
    result = dict(
        command=invocation(__file__),
        device=torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
        torch=torch.__version__,
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
