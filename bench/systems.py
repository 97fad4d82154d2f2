"""The systems `offline_throughput.py` measures, each run in its own subprocess:
ours (`LLM.generate`), HF static-batch `generate`, HF continuous batching, and an
unbatched HF reference for the token check. See bench/README.md."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MODEL_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
PAD_ID = 0
BLOCK_SIZE = 16
WARMUP_PROMPTS = [[1, 450, 4996, 17354], [1, 910, 338, 263, 1243, 310]]
WARMUP_TOKENS = 8


def log(msg: str) -> None:
    print(f"[offline_throughput] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- helpers


def peak_rss_mib() -> float:
    """Peak resident set size of this process (VmHWM), MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def kv_bytes_per_token(dtype: str, shape: dict | None = None, kv_cache_dtype: str = "auto") -> int:
    """One token's K and V bytes in every layer: rows of `dtype`, or with an 8-bit
    `kv_cache_dtype` one byte per value and a 4-byte scale per row."""
    shape = shape or MODEL_SHAPE
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    rows = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"]
    if kv_cache_dtype != "auto":
        return rows * (head_dim + 4)
    return rows * head_dim * (4 if dtype == "float32" else 2)


def default_kv_cache_memory(input_lens, output_lens, max_num_seqs: int, dtype: str) -> int:
    """Blocks for the max_num_seqs longest requests at full length: no request can ever be
    preempted for lack of blocks (and at least one max-length sequence)."""
    pairs = zip(input_lens, output_lens, strict=True)
    blocks = sorted((-(-(i + o) // BLOCK_SIZE) for i, o in pairs), reverse=True)
    one_seq = -(-MODEL_SHAPE["max_position_embeddings"] // BLOCK_SIZE)
    need = max(sum(blocks[:max_num_seqs]), one_seq)
    return need * BLOCK_SIZE * kv_bytes_per_token(dtype)


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def write_model(workdir: Path, seed: int, shape: dict | None = None) -> int:
    """config.json + model.safetensors (HF's seeded init, float32) of a Llama of `shape`
    (default MODEL_SHAPE); returns #params."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(shape or MODEL_SHAPE), architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(workdir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(workdir)
    return sum(p.numel() for p in model.parameters())


def load_hf_model(workdir: Path, dtype: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        workdir, dtype=torch_dtype(dtype), attn_implementation="sdpa"
    )
    return model.eval()


def throughput(wall: float, outputs: list[list[int]], wl: dict) -> dict:
    out_tokens = sum(len(o) for o in outputs)
    return {
        "wall_s": round(wall, 3),
        "num_requests": len(outputs),
        "output_tokens": out_tokens,
        "requests_per_s": round(len(outputs) / wall, 4),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "total_tokens_per_s": round((out_tokens + sum(map(len, wl["prompts"]))) / wall, 2),
    }


# ---------------------------------------------------------------------------- systems


def run_ours(args, wl: dict) -> tuple[dict, list[list[int]]]:
    from engine import LLM, SamplingParams

    llm = LLM(
        model=str(args.workdir),
        load_format="auto",
        skip_tokenizer_init=True,
        seed=0,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=BLOCK_SIZE,
    )
    warm = SamplingParams(temperature=0, ignore_eos=True, max_tokens=WARMUP_TOKENS)
    llm.generate(WARMUP_PROMPTS, warm, use_tqdm=False)
    before = llm.stats()
    util = getattr(llm.engine, "utilization", None)
    util0 = (util.tokens, util.slots) if util is not None else None
    rss_before = current_rss_mib()
    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in wl["output_lens"]
    ]
    t0 = time.perf_counter()
    outs = llm.generate(wl["prompts"], params, use_tqdm=True)
    wall = time.perf_counter() - t0
    after = llm.stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    result = throughput(wall, tokens, wl)
    if util0 is not None and util.slots > util0[1]:
        mean_util = (util.tokens - util0[0]) / (util.slots - util0[1])
    else:
        mean_util = after.mean_kv_slot_utilization
    result.update(
        mean_kv_slot_utilization=round(mean_util, 4),
        num_preemptions=after.num_preemptions - before.num_preemptions,
        num_steps=after.num_steps - before.num_steps,
        num_kv_blocks=after.num_blocks,
        kv_cache_mib=round(
            after.num_blocks * BLOCK_SIZE * kv_bytes_per_token(args.dtype) / 2**20, 1
        ),
        rss_before_run_mib=rss_before,
        finish_reasons=sorted({o.outputs[0].finish_reason for o in outs}),
    )
    return result, tokens


def run_hf_static(args, wl: dict) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import GenerationConfig

    model = load_hf_model(args.workdir, args.dtype)
    bs = args.batch_size

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        cfg = GenerationConfig(
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
            bos_token_id=1,
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:].tolist()

    gen(WARMUP_PROMPTS, WARMUP_TOKENS)
    rss_before = current_rss_mib()
    prompts, lens = wl["prompts"], wl["output_lens"]
    tokens: list[list[int]] = []
    computed = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), bs):
        batch, want = prompts[start : start + bs], lens[start : start + bs]
        n = max(want)
        rows = gen(batch, n)
        computed += n * len(batch)
        # only each request's own tokens count; the rest of the batch tail is waste
        tokens += [row[:w] for row, w in zip(rows, want, strict=True)]
        log(
            f"hf_static B={bs}: {len(tokens)}/{len(prompts)} requests, "
            f"{time.perf_counter() - t0:.1f}s"
        )
    wall = time.perf_counter() - t0
    result = throughput(wall, tokens, wl)
    result.update(
        batch_size=bs, generated_tokens_incl_batch_tail=computed, rss_before_run_mib=rss_before
    )
    return result, tokens


def run_hf_cb(args, wl: dict) -> tuple[dict, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf_model(args.workdir, args.dtype)
    page = args.hf_cb_page_size
    num_blocks = args.kv_cache_memory // (page * kv_bytes_per_token(args.dtype))
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=num_blocks,
        max_batch_tokens=args.hf_cb_max_batch_tokens,
        max_requests_per_batch=args.hf_cb_max_requests,
        seed=0,
    )
    gen_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID, max_new_tokens=max(wl["output_lens"])
    )
    prompts, lens = wl["prompts"], wl["output_lens"]

    def run(mgr, batch, want, tag) -> list[list[int]]:
        ids = [
            mgr.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(batch, want, strict=True))
        ]
        done: dict[str, object] = {}
        while len(done) < len(ids):
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"hf_cb request {res.request_id} failed: {res.error}")
                done[res.request_id] = res
                if tag == "r" and len(done) % 25 == 0:
                    log(f"hf_cb: {len(done)}/{len(ids)} requests")
            elif res is None and not mgr.is_running():
                raise RuntimeError("hf_cb generation thread stopped unexpectedly")
        return [list(done[i].generated_tokens) for i in ids]

    # No inference_mode here: the manager's thread updates its cache tensors in place and
    # runs under no_grad itself.
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        warmup=True,
    ) as mgr:
        run(mgr, WARMUP_PROMPTS, [WARMUP_TOKENS] * 2, "w")
        rss_before = current_rss_mib()
        t0 = time.perf_counter()
        tokens = run(mgr, prompts, lens, "r")
        wall = time.perf_counter() - t0
        cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
    result = throughput(wall, tokens, wl)
    result.update(
        page_size=page,
        num_blocks_requested=num_blocks,
        attn_implementation=model.config._attn_implementation,
        rss_before_run_mib=rss_before,
    )
    if cache is not None:
        result.update(
            num_blocks=getattr(cache, "num_blocks", None),
            max_batch_tokens=getattr(cache, "max_batch_tokens", None),
        )
    return result, tokens


def run_hf_reference(args, wl: dict) -> tuple[dict, list[list[int]]]:
    """Unbatched, unpadded HF greedy generate on the first --check-requests prompts."""
    import torch

    model = load_hf_model(args.workdir, args.dtype)
    tokens = []
    pairs = zip(wl["prompts"], wl["output_lens"], strict=True)
    for p, n in list(pairs)[: args.check_requests]:
        n = min(n, args.check_tokens)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_ID,
            )
        tokens.append(out[0, len(p) :].tolist())
    return {"num_requests": len(tokens)}, tokens


SYSTEMS = {
    "ours": run_ours,
    "hf_static": run_hf_static,
    "hf_cb": run_hf_cb,
    "hf_reference": run_hf_reference,
}


def child_main(args) -> None:
    """Runs one system in this process and writes {result, tokens} to --result-file."""
    import torch

    torch.set_num_threads(args.threads)
    wl = json.loads((args.workdir / "workload.json").read_text())
    result, tokens = SYSTEMS[args.system](args, wl)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    result["torch_threads"] = torch.get_num_threads()
    args.result_file.write_text(json.dumps({"result": result, "tokens": tokens}))
