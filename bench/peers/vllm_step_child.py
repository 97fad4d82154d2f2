"""vLLM's whole-step times on bench/step_profile.py's shapes, run by the vLLM venv's python.

    python vllm_step_child.py --model DIR --spec '{"batch": [1, 16], "context": 256, ...}'

Per batch B, decode: B prompts of `context` tokens generated to 1 token, then again to
1 + `steps` tokens (prefix caching off, so both compute the prompts); the difference over
`steps` is one decode step at batch B. Prefill: B prompts of `prompt_len` tokens to 1
token, over the number of 2,048-token steps that takes. Writes JSON to --result-file.
"""

import argparse
import json
import random
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--result-file", required=True)
    args = p.parse_args()
    spec = json.loads(args.spec)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=spec["dtype"], skip_tokenizer_init=True,
              max_num_seqs=max(spec["batch"]), max_num_batched_tokens=2048,
              enable_prefix_caching=False)  # fmt: skip

    def run(prompts, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sp, use_tqdm=False)
        return time.perf_counter() - started

    run(_prompts(2, 16, 0), 4)  # warm-up
    out = {"decode": {}, "prefill": {}}
    for b in spec["batch"]:
        prompts = _prompts(b, spec["context"], b)
        first = run(prompts, 1)
        whole = run(prompts, 1 + spec["steps"])
        out["decode"][str(b)] = {"step_ms": round((whole - first) / spec["steps"] * 1e3, 3)}
        prompts = _prompts(b, spec["prompt_len"], 1000 + b)
        steps = -(-b * spec["prompt_len"] // 2048)
        out["prefill"][str(b)] = {
            "step_ms": round(run(prompts, 1) / steps * 1e3, 3),
            "steps": steps,
        }
    with open(args.result_file, "w") as f:
        json.dump(out, f)


def _prompts(batch, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(batch)]


if __name__ == "__main__":
    main()
