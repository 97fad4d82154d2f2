"""Serving throughput on a GPU beside transformers, KV sizing, and decode steps against the
bandwidth floor.

Two Llama shapes with random weights in bfloat16: a 1.2B one (bench/gpu_e2e.py's) and
Llama-3-8B's (32 layers, 4096 wide, 8 KV heads, 128,256-token vocabulary). For each:

  - KV sizing: the blocks `gpu_memory_utilization` gives, and the device memory the
    engine peaked at over a full run, as shares of the card (the peak must stay under the
    utilization);
  - throughput on the same random prompts: our engine offline (one step ahead and in
    step) against transformers' `generate` in static batches and its continuous batching
    (`generate_batch`: its paged cache, its own scheduler and CUDA graphs);
  - the decode step: two runs of B sequences that differ only in how many tokens they
    decode, so prefill cancels: (t_long - t_short) / extra tokens is one step; the floor is
    the bytes a step must read (every weight but the embedding table, plus each sequence's
    K/V) over the copy bandwidth measured here.

Every row is written to --out as soon as it is measured, so a stage cut short by its time
limit keeps what ran before it. The models differ from any real checkpoint only in their
values, and tokens are not compared across systems (different random weights).

    python bench/gpu_throughput.py --out bench/results/gpu_throughput.json
    python bench/gpu_throughput.py --device cpu --shapes tiny --num-prompts 4 \\
        --input-len 16 --output-len 8 --steps-batches 2   # a dry run of the code
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from gpu_e2e import LLAMA_1B  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

SHAPES = {
    "1b": LLAMA_1B,
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(  # the dry run's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
    ),
}


def log(msg: str) -> None:
    print(f"[gpu_throughput] {msg}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Bytes per second of a device-to-device copy (read plus write), median of five."""
    if device != "cuda":
        return 0.0
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / sorted(times)[2]


def hf_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**shape, dtype="bfloat16", architectures=["LlamaForCausalLM"])


def bytes_per_step(shape: dict) -> dict:
    """What one decode step must read: every weight but the embedding table (the output
    matrix is read whole), and per token of context one K and one V row per layer."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(shape))
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        weights += model.lm_head.weight.numel()
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim
    return dict(weight_bytes=2 * weights, kv_bytes_per_token=2 * kv_per_token)


def random_prompts(shape: dict, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, shape["vocab_size"]) for _ in range(length)] for _ in range(count)]


def open_llm(model_dir: Path, device: str, max_num_seqs: int, depth: int, util: float) -> LLM:
    return LLM(
        str(model_dir),
        device=device,
        dtype="bfloat16",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=util,
        kv_cache_memory=None if device == "cuda" else 64 * 2**20,
        pipeline_depth=depth,
    )


def timed_generate(llm: LLM, prompts, out_len: int, device: str) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def ours(a, model_dir: Path, prompts, depth: int, sizing: bool) -> dict:
    """Our engine offline; with `sizing`, also what gpu_memory_utilization gave."""
    with open_llm(model_dir, a.device, a.max_num_seqs, depth, a.gpu_memory_utilization) as llm:
        timed_generate(llm, prompts, 4, a.device)  # warm-up at the run's shapes
        seconds, generated = timed_generate(llm, prompts, a.output_len, a.device)
        row = dict(
            system="pagedserve",
            pipeline_depth=depth,
            max_num_seqs=a.max_num_seqs,
            seconds=round(seconds, 2),
            output_tok_s=round(generated / seconds, 1),
        )
        if sizing:
            row["kv_sizing"] = kv_sizing(llm, a)
    return row


def kv_sizing(llm: LLM, a) -> dict:
    stats = llm.stats()
    sizing = dict(
        gpu_memory_utilization=a.gpu_memory_utilization,
        num_blocks=stats.num_blocks,
    )
    if a.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        sizing.update(
            total_gib=round(total / 2**30, 1),
            allocated_share=round(torch.cuda.memory_allocated() / total, 3),
            peak_share=round(torch.cuda.max_memory_allocated() / total, 3),
            reserved_peak_share=round(torch.cuda.max_memory_reserved() / total, 3),
        )
        sizing["peak_under_utilization"] = sizing["reserved_peak_share"] <= a.gpu_memory_utilization
    return sizing


def decode_steps(a, model_dir: Path, shape: dict, bandwidth: float) -> list[dict]:
    """Per batch size: one decode step's time (two run lengths, prefill cancels) against
    the floor of the bytes it must read over the copy bandwidth."""
    need = bytes_per_step(shape)
    short, long = a.step_tokens
    rows = []
    with open_llm(model_dir, a.device, max(a.steps_batches), 2, a.gpu_memory_utilization) as llm:
        timed_generate(llm, random_prompts(shape, 2, a.step_context, seed=9), 4, a.device)
        for batch in a.steps_batches:
            prompts = random_prompts(shape, batch, a.step_context, seed=batch)
            timed_generate(llm, prompts, short, a.device)  # warm-up at this batch's shapes
            t_short, _ = timed_generate(llm, prompts, short, a.device)
            t_long, _ = timed_generate(llm, prompts, long, a.device)
            step = (t_long - t_short) / (long - short)
            context = a.step_context + (short + long) / 2
            floor_bytes = need["weight_bytes"] + batch * context * need["kv_bytes_per_token"]
            floor = floor_bytes / bandwidth if bandwidth else 0.0
            rows.append(
                dict(
                    batch=batch,
                    mean_context=context,
                    step_ms=round(step * 1e3, 3),
                    floor_ms=round(floor * 1e3, 3),
                    over_floor=round(step / floor, 2) if floor else None,
                    decode_tok_s=round(batch / step, 1),
                )
            )
            log(f"step {rows[-1]}")
    return rows


def hf_model(shape: dict, device: str):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(shape))
    return model.to(torch.bfloat16).eval()


def hf_static(a, shape: dict, prompts) -> dict:
    """transformers `generate` in static batches of --hf-batch (equal lengths: no padding)."""
    model = hf_model(shape, a.device)
    ids = torch.tensor(prompts, device=a.device)

    def run(rows, new):
        return model.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )

    run(ids[:2], 4)
    sync(a.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), a.hf_batch):
        run(ids[i : i + a.hf_batch], a.output_len)
    sync(a.device)
    seconds = time.perf_counter() - start
    return dict(
        system="hf_generate_static",
        batch=a.hf_batch,
        seconds=round(seconds, 2),
        output_tok_s=round(len(prompts) * a.output_len / seconds, 1),
    )


def hf_continuous(a, shape: dict, prompts) -> dict:
    """transformers' continuous batching (`generate_batch`), warmed up on a few prompts
    first; the timed call includes setting up its manager."""
    from transformers import GenerationConfig

    model = hf_model(shape, a.device)
    config = GenerationConfig(
        max_new_tokens=a.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    model.generate_batch(prompts[:4], config, max_new_tokens=4)
    sync(a.device)
    start = time.perf_counter()
    outs = model.generate_batch(prompts, config)
    sync(a.device)
    seconds = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outs.values())
    return dict(
        system="hf_generate_batch",
        seconds=round(seconds, 2),
        output_tok_s=round(generated / seconds, 1),
        generated=generated,
    )


def guarded(rows: list, name: str, fn, *args) -> None:
    """Appends fn's row (or rows), or the error it raised; the next stages still run."""
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a report of what broke is the point
        result = dict(
            ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:]
        )
    items = result if isinstance(result, list) else [result]
    for item in items:
        item.setdefault("part", name)
        item.setdefault("wall_s", round(time.perf_counter() - start, 1))
    rows.extend(items)
    log(f"{name}: {json.dumps(items)[:1200]}")


def measure_shape(a, name: str, bandwidth: float, report: dict) -> None:
    shape = SHAPES[name]
    rows: list[dict] = []
    entry = dict(shape=name, config=shape, **bytes_per_step(shape), rows=rows)
    report["shapes"].append(entry)
    prompts = random_prompts(shape, a.num_prompts, a.input_len)
    with tempfile.TemporaryDirectory() as tmp:
        hf_config(shape).save_pretrained(tmp)  # config.json: load_format="dummy"
        for depth in (2, 1) if "ours" in a.parts else ():
            guarded(rows, f"ours depth {depth}", ours, a, Path(tmp), prompts, depth, depth == 2)
            release(a.device)
            save(a, report)
        if "steps" in a.parts:
            guarded(rows, "decode steps", decode_steps, a, Path(tmp), shape, bandwidth)
            release(a.device)
            save(a, report)
    for part, fn in [("hf static", hf_static), ("hf continuous", hf_continuous)]:
        if part.split()[1] in a.hf and "hf" in a.parts:
            guarded(rows, part, fn, a, shape, prompts)
            release(a.device)
            save(a, report)
    best = max((r["output_tok_s"] for r in rows if r.get("system") == "pagedserve"), default=0)
    for r in rows:
        if r.get("system", "").startswith("hf_") and r.get("output_tok_s"):
            entry[f"ours_over_{r['system']}"] = round(best / r["output_tok_s"], 2)


def save(a, report: dict) -> None:
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hf-batch", type=int, default=128)
    p.add_argument(
        "--parts", nargs="+", default=["ours", "steps", "hf"], choices=["ours", "steps", "hf"]
    )
    p.add_argument("--hf", nargs="*", default=["static", "continuous"], help="transformers' modes")
    p.add_argument("--steps-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--step-context", type=int, default=512)
    p.add_argument("--step-tokens", type=int, nargs=2, default=[32, 160], metavar=("SHORT", "LONG"))
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the code")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    bandwidth = copy_bandwidth(a.device)
    report = dict(
        command=invocation(__file__),
        machine=machine(),
        device=torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
        torch=torch.__version__,
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        shapes=[],
    )
    log(f"copy bandwidth {report['copy_bandwidth_gb_s']} GB/s")
    for name in a.shapes:
        measure_shape(a, name, bandwidth, report)
    write_report(report, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
