"""vLLM's `LLM.generate` on a token-id workload, run by the vLLM venv's python (so it
imports nothing of pagedserve): bench/peers/vllm_peer.py starts it.

    /tmp/vllm-venv/bin/python vllm_offline_child.py --model DIR --workload workload.json \
        --result-file out.json --dtype float32 [--max-num-seqs 128] [--kw JSON]

workload.json: {"prompts": [[ids...], ...], "output_lens": [n, ...]}. Greedy, ignore_eos,
two short warm-up requests untimed (vLLM compiles the model first: that is start-up, not
timed). The result: wall seconds of the one timed generate, peak RSS of this process and
its children summed (vLLM's V1 `LLM` runs its engine core in a child process), every
request's output token ids.
"""

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--result-file", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--kw", default="{}", help="more LLM(...) keyword arguments, as JSON")
    args = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(open(args.workload).read())
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in data["prompts"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in data["output_lens"]
    ]
    kw = json.loads(args.kw)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, **kw)
    warm = [TokensPrompt(prompt_token_ids=ids[:8]) for ids in data["prompts"][:2]]
    llm.generate(
        warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    startup_s = time.perf_counter() - started
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {
        "wall_s": round(wall, 3),
        "startup_s": round(startup_s, 1),
        "peak_rss_mib": round(sum(_peak_rss_mib(pid) for pid in _tree(os.getpid())), 1),
        "llm_kwargs": kw,
    }
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    with open(args.result_file, "w") as f:
        json.dump({"result": result, "tokens": tokens}, f)


def _tree(root: int) -> list[int]:
    """root and its live descendants, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        out += frontier
    return out


def _peak_rss_mib(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


if __name__ == "__main__":
    main()
