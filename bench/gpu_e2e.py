"""The whole engine on a CUDA device: checked token for token, then timed.

Checks (a real checkpoint, stories260K, float32 so the CPU is an exact reference):
  - llama2.c's own greedy outputs, batched, whole prompts and 64-token chunks, and with
    the scheduler one step ahead (pipeline_depth=2);
  - the same requests on CUDA and on the CPU give the same tokens: greedy with logprobs,
    beam search, shared prefixes (prefix caching) and a KV cache small enough to preempt;
  - float16 / bfloat16 run, with the share of greedy tokens equal to float32's;
  - n=4 seeded sampling finishes with four outputs;
  - structured outputs (xgrammar's masks on this device's logits) on the built-in model;
  - the families with sliding windows, soft caps, sinks or experts (tiny random configs)
    against transformers' greedy tokens, through prefix hits, one step ahead and swapping.
Timing: a random Llama-shaped model (about 1.2B parameters, bfloat16) serving random
prompts offline, our engine against Hugging Face `generate` on the same weights.

    python bench/gpu_e2e.py --stories DIR --reference FILE --out bench/results/gpu_e2e.json
    python bench/gpu_e2e.py ... --device cpu --parts checks   # a dry run of the checks' code
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def log(msg: str) -> None:
    print(f"[gpu_e2e] {msg}", file=sys.stderr, flush=True)


def native(device: str) -> dict:
    """On CUDA, insist on our kernels: 'auto' would fall back to SDPA if they broke."""
    return {"attention_backend": "native"} if device.startswith("cuda") else {}


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def reference_params(cases) -> list[SamplingParams]:
    # llama2.c counts positions after BOS: prompt - 1 + generated <= max_total_tokens.
    return [
        SamplingParams(
            temperature=0, max_tokens=c["max_total_tokens"] - len(c["prompt_token_ids"]) + 1
        )
        for c in cases
    ]


def check_reference(stories: str, device: str, cases, **kwargs) -> dict:
    kwargs |= native(device)
    with LLM(stories, device=device, dtype="float32", kv_cache_memory=32 << 20, **kwargs) as llm:
        outs = llm.generate(
            [c["prompt_token_ids"] for c in cases], reference_params(cases), use_tqdm=False
        )
    got = [o.outputs[0].token_ids for o in outs]
    matches = [g == c["greedy_token_ids"] for g, c in zip(got, cases, strict=True)]
    return dict(cases=len(cases), identical=sum(matches), ok=all(matches))


def scenario() -> tuple[list[list[int]], list[SamplingParams]]:
    """Shared prefixes, greedy with logprobs, and beam search, on the stories vocabulary."""
    rng = random.Random(0)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(40)]
    prompts = [
        prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(12)
    ]
    params = [SamplingParams(temperature=0, max_tokens=48, logprobs=2, ignore_eos=True)] * 10
    params += [SamplingParams(n=2, use_beam_search=True, max_tokens=24, temperature=0)] * 2
    return prompts, params


def check_against_cpu(stories: str, device: str, kv_cache_memory: int) -> dict:
    prompts, params = scenario()
    runs = {}
    for where in ("cpu", device):
        with LLM(
            stories, device=where, dtype="float32", kv_cache_memory=kv_cache_memory, **native(where)
        ) as llm:
            runs[where] = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.stats()
    same = [a == b for a, b in zip(tokens(runs["cpu"]), tokens(runs[device]), strict=True)]
    worst = 0.0
    for a, b in zip(runs["cpu"][:10], runs[device][:10], strict=True):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=False):
            for tid, lp in la.items():
                if tid in lb:
                    worst = max(worst, abs(lp.logprob - lb[tid].logprob))
    return dict(
        kv_cache_memory=kv_cache_memory,
        requests=len(prompts),
        identical=sum(same),
        ok=all(same),
        max_logprob_diff=worst,
        stats=str(stats)[:400],
    )


def check_half_dtypes(stories: str, device: str, cases) -> dict:
    prompts = [c["prompt_token_ids"] for c in cases]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    result = {}
    base = None
    for dtype in ("float32", "float16", "bfloat16"):
        with LLM(
            stories, device=device, dtype=dtype, kv_cache_memory=32 << 20, **native(device)
        ) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        base = base or got
        agree = sum(
            x == y for g, b in zip(got, base, strict=True) for x, y in zip(g, b, strict=True)
        )
        result[dtype] = round(agree / sum(len(b) for b in base), 3)
    return dict(greedy_tokens_equal_to_float32=result)


def check_sampling(stories: str, device: str) -> dict:
    with LLM(stories, device=device, kv_cache_memory=32 << 20, **native(device)) as llm:
        [out] = llm.generate(
            [1, 400, 30],
            SamplingParams(n=4, seed=7, max_tokens=20, temperature=0.8),
            use_tqdm=False,
        )
        [again] = llm.generate(
            [1, 400, 30],
            SamplingParams(n=4, seed=7, max_tokens=20, temperature=0.8),
            use_tqdm=False,
        )
    return dict(
        outputs=len(out.outputs),
        seeded_repeatable=tokens([out]) == tokens([again]),
        ok=len(out.outputs) == 4,
    )


def check_structured(device: str) -> dict:
    """Every constraint of tests/engine/test_structured_outputs.py (JSON schemas, regex,
    choice, EBNF) on the built-in random model, greedy and sampled beside an unconstrained
    request, in step and one step ahead: the masks applied to this device's logits."""
    from tests.engine.test_structured_outputs import run_all_cases

    for depth in (1, 2):
        with LLM(
            "builtin:tiny",
            device=device,
            block_size=16,
            seed=0,
            kv_cache_memory=32 << 20,
            pipeline_depth=depth,
            **native(device),
        ) as llm:
            run_all_cases(llm)  # raises unless every output matches its constraint
    return dict(ok=True, pipeline_depths=[1, 2])


FAMILIES = (
    "mistral-window",
    "qwen2-hybrid",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt-oss",
    "mixtral",
    "qwen3-moe",
    "qwen3.5",  # linear attention: block size raised to 32 so a page holds a state
    "qwen3-next",
)


def check_families(device: str) -> dict:
    """Each family of FAMILIES (tests/engine/tiny_models.py: windows shorter than most of
    the prompts) on this device with our kernels, against transformers' own greedy tokens
    (CPU, float32): twice over the same prompts, so the second pass hits the prefix cache,
    in 8-token blocks, in 16-token blocks one step ahead, and in a cache that holds about
    one sequence (swap preemption)."""
    from engine.worker.kv_cache import block_bytes
    from tests.engine.tiny_models import VOCAB, hf_greedy, save_hf_model

    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (2, 5, 9, 17, 30, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            path = str(Path(tmp) / name)
            expected = [hf_greedy(save_hf_model(name, Path(path)), p, 10) for p in prompts]
            base = dict(device=device, dtype="float32", skip_tokenizer_init=True, seed=0)
            base |= dict(max_model_len=64, **native(device))
            roomy = 64 << 20  # explicit: tests share the GPU, so free memory varies
            with LLM(path, **base, block_size=16, kv_cache_memory=roomy) as probe:
                layout = probe.config.model.kv_cache_layout
                bs = probe.config.cache.block_size  # raised where a state needs more
                per_block = block_bytes(probe.config.model, bs)
            one = layout.max_blocks_per_sequence(64, 16, bs)
            tight = dict(
                block_size=bs,
                max_num_batched_tokens=16,
                kv_cache_memory=per_block * (one + 3),
                swap_space=per_block * 64 / 1024**3,
                preemption_mode="swap",
            )
            runs = {}
            configs = dict(
                block8=dict(block_size=8, kv_cache_memory=roomy),
                block16_one_step_ahead=dict(block_size=16, pipeline_depth=2, kv_cache_memory=roomy),
                swapping=tight,
            )
            for label, kwargs in configs.items():
                try:
                    with LLM(path, **base, **kwargs) as llm:
                        for second in (False, True):
                            outs = llm.generate(prompts, params, use_tqdm=False)
                            same = [o.outputs[0].token_ids for o in outs] == expected
                            runs[label + ("_again" if second else "")] = same
                        runs[label + "_swaps"] = llm.stats().num_swaps
                except Exception as exc:  # noqa: BLE001 - report it, run the other configs
                    runs[label] = False
                    runs[label + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
            results[name] = runs
            log(f"{name}: {runs}")
    ok = all(v for r in results.values() for v in r.values() if isinstance(v, bool))
    swapped = all(r.get("swapping_swaps", 0) > 0 for r in results.values())
    return dict(families=results, ok=ok and swapped, every_tight_run_swapped=swapped)


SPEC_FAMILIES = ("llama", "qwen3", "mistral-window", "gemma2", "gpt-oss", "mixtral")
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 64,
}


def check_speculative(device: str) -> dict:
    """Prompt-lookup speculative decoding on this device: each family of SPEC_FAMILIES
    (tiny random configs, prompts that repeat themselves) gives the same greedy tokens
    with drafts verified as without, in step, one step ahead, and in a cache small
    enough to swap."""
    from tests.engine.tiny_models import VOCAB, save_hf_model

    rng = random.Random(4)
    prompts = []
    for i in range(6):
        piece = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
        prompts.append((piece * 8)[: rng.randint(6, 30)] if i % 3 else piece)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in SPEC_FAMILIES:
            path = str(Path(tmp) / name)
            save_hf_model(name, Path(path))
            base = dict(device=device, dtype="float32", skip_tokenizer_init=True, seed=0)
            base |= dict(max_model_len=96, block_size=16, kv_cache_memory=64 << 20)
            base |= native(device)
            with LLM(path, **base) as llm:
                expected = tokens(llm.generate(prompts, params, use_tqdm=False))
            runs = {}
            for label, extra in dict(in_step={}, one_step_ahead=dict(pipeline_depth=2)).items():
                try:
                    with LLM(path, **base, **extra, speculative_config=NGRAM) as llm:
                        got = tokens(llm.generate(prompts, params, use_tqdm=False))
                        stats = llm.stats()
                    runs[label] = got == expected
                    runs[label + "_accepted"] = stats.spec_decode_num_accepted_tokens
                    runs[label + "_verified"] = stats.spec_decode_num_draft_tokens
                except Exception as exc:  # noqa: BLE001 - report it, run the others
                    runs[label] = False
                    runs[label + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
            results[name] = runs
            log(f"speculative {name}: {runs}")
    ok = all(v for r in results.values() for k, v in r.items() if isinstance(v, bool))
    accepted = all(r.get("in_step_accepted", 0) > 0 for r in results.values())
    return dict(families=results, ok=ok and accepted)


def spec_throughput(stories: str | None = None, batches=(1, 8, 32), out_len: int = 128) -> dict:
    """Output tok/s without and with ngram drafts (k = 3) per batch size: the random
    1.2B Llama (bfloat16) on prompts that repeat a random piece, or with `stories`
    that checkpoint (float32) on story openings (it repeats names and phrases, so
    lookup finds drafts)."""
    rng = random.Random(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if stories is None:
            random_llama(Path(tmp))
            vocab, dtype, path = LLAMA_1B["vocab_size"], "bfloat16", tmp
        else:
            vocab, dtype, path = 512, "float32", stories
        for batch in batches:
            prompts = []
            for _ in range(2 * batch):
                piece = [rng.randrange(3, vocab) for _ in range(8)]
                prompts.append(piece * 8 if stories is None else [1] + piece[:2])
            params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
            base = None
            for spec in (None, {**NGRAM, "prompt_lookup_min": 2, "disable_by_batch_size": 1024}):
                with LLM(
                    str(path),
                    device="cuda",
                    dtype=dtype,
                    skip_tokenizer_init=True,
                    max_num_seqs=batch,
                    kv_cache_memory=4 << 30,  # the last engine's memory may not be back yet
                    attention_backend="native",
                    speculative_config=spec,
                ) as llm:
                    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    stats = llm.stats()
                got = tokens(outs)
                row = dict(
                    batch=batch,
                    speculative=spec is not None,
                    output_tok_s=round(len(prompts) * out_len / seconds, 1),
                    acceptance_rate=round(stats.spec_decode_acceptance_rate, 3),
                    mean_accepted_length=round(stats.spec_decode_mean_accepted_length, 3),
                )
                if base is None:
                    base, base_tokens = row, got
                row["speedup"] = round(row["output_tok_s"] / base["output_tok_s"], 3)
                row["tokens_identical"] = sum(a == b for a, b in zip(got, base_tokens, strict=True))
                rows.append(row)
                log(f"spec_throughput {row}")
    return dict(model=stories or LLAMA_1B, dtype=dtype, output_len=out_len, rows=rows)


LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def random_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(path)


def time_ours(path: Path, prompts, out_len: int, max_num_seqs: int, depth: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    with LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=0.3,
        pipeline_depth=depth,
        attention_backend="native",
    ) as llm:
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(
        system="ours",
        max_num_seqs=max_num_seqs,
        pipeline_depth=depth,
        seconds=round(seconds, 2),
        output_tok_s=round(generated / seconds, 1),
        total_tok_s=round((generated + sum(len(p) for p in prompts)) / seconds, 1),
    )


def time_hf(path: Path, prompts, out_len: int, batch: int) -> dict:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")  # equal lengths: no padding

    def run(rows):
        mask = torch.ones_like(rows)
        return model.generate(
            rows,
            attention_mask=mask,
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
        )

    run(ids[:2])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        run(ids[i : i + batch])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = len(prompts) * out_len
    return dict(
        system="hf_generate",
        batch=batch,
        seconds=round(seconds, 2),
        output_tok_s=round(generated / seconds, 1),
        total_tok_s=round((generated + ids.numel()) / seconds, 1),
    )


def throughput(num_prompts: int, in_len: int, out_len: int, hf_batch: int) -> dict:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, LLAMA_1B["vocab_size"]) for _ in range(in_len)]
        for _ in range(num_prompts)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        random_llama(Path(tmp))
        for max_num_seqs, depth in [(256, 2), (256, 1)]:
            rows.append(time_ours(Path(tmp), prompts, out_len, max_num_seqs, depth))
            log(str(rows[-1]))
        rows.append(time_hf(Path(tmp), prompts, out_len, hf_batch))
        log(str(rows[-1]))
    ours = max(r["output_tok_s"] for r in rows if r["system"] == "ours")
    return dict(
        model=LLAMA_1B,
        num_prompts=num_prompts,
        input_len=in_len,
        output_len=out_len,
        rows=rows,
        ours_best_over_hf=round(ours / rows[-1]["output_tok_s"], 2),
    )


def guarded(name: str, fn, *args) -> dict:
    """One part's result, or the error it raised (the other parts still run)."""
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a report of what broke is the point
        result = dict(
            ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
        )
    result["seconds"] = round(time.perf_counter() - start, 1)
    log(f"{name}: {json.dumps(result)[:1500]}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stories", required=True, help="the stories260K checkpoint directory")
    p.add_argument("--reference", required=True, help="llama2.c's stories260K_greedy.json")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=128)
    p.add_argument(
        "--parts",
        nargs="+",
        choices=[
            "checks",
            "structured",
            "families",
            "throughput",
            "speculative",
            "spec_throughput",
            "spec_stories",
        ],
        default=["checks", "structured", "families", "throughput"],
    )
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the checks' code")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    cases = json.loads(Path(a.reference).read_text())["cases"]
    stories, dev = a.stories, a.device
    checks = (
        {}
        if "checks" not in a.parts
        else dict(
            reference=guarded("reference", check_reference, stories, dev, cases),
            reference_chunked=guarded(
                "reference_chunked",
                lambda: check_reference(stories, dev, cases, max_num_batched_tokens=64),
            ),
            reference_one_step_ahead=guarded(
                "reference_one_step_ahead",
                lambda: check_reference(stories, dev, cases, pipeline_depth=2),
            ),
            against_cpu=guarded("against_cpu", check_against_cpu, stories, dev, 32 << 20),
            against_cpu_preempting=guarded(
                "against_cpu_preempting", check_against_cpu, stories, dev, 1 << 20
            ),
            half_dtypes=guarded("half_dtypes", check_half_dtypes, stories, dev, cases),
            sampling=guarded("sampling", check_sampling, stories, dev),
        )
    )
    result = dict(
        command=invocation(__file__),
        device=torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
        torch=torch.__version__,
        checks=checks,
        machine=machine(),
    )
    if "structured" in a.parts:
        checks["structured"] = guarded("structured", check_structured, dev)
    if "families" in a.parts:
        checks["families"] = guarded("families", check_families, dev)
    if "speculative" in a.parts:
        checks["speculative"] = guarded("speculative", check_speculative, dev)
    if "spec_throughput" in a.parts:
        result["spec_throughput"] = guarded("spec_throughput", spec_throughput)
    if "spec_stories" in a.parts:
        result["spec_stories"] = guarded("spec_stories", spec_throughput, stories)
    if "throughput" in a.parts:
        result["throughput"] = guarded(
            "throughput", throughput, a.num_prompts, a.input_len, a.output_len, a.hf_batch
        )
    write_report(result, a.out)
    return 0 if all(c.get("ok", True) for c in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
