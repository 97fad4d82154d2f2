"""A draft model on CUDA: three tiny families, each drafted by a one-layer copy of itself,
give the same greedy tokens with drafts as without, in step and one step ahead, with
the native CUDA kernels (float32). Run on a lent GPU:

    python bench/gpu_spec_draft.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from engine import LLM, SamplingParams  # noqa: E402
from tests.engine.test_speculative_decoding import (  # noqa: E402
    draft_config,
    prompts,
    truncated_copy,
)
from tests.engine.tiny_models import save_hf_model  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def check(name: str) -> bool:
    same_everywhere = True
    with tempfile.TemporaryDirectory() as target, tempfile.TemporaryDirectory() as draft:
        save_hf_model(name, Path(target))
        truncated_copy(name, Path(draft))
        base = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, seed=0)
        base |= dict(max_model_len=96, kv_cache_memory=64 << 20, attention_backend="native")
        ps = prompts(9)
        with LLM(target, **base) as llm:
            want = [o.outputs[0].token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
        for depth in (1, 2):
            spec = draft_config(draft)
            with LLM(target, **base, pipeline_depth=depth, speculative_config=spec) as llm:
                got = [o.outputs[0].token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
                s = llm.stats()
            same = got == want
            same_everywhere &= same
            accepted = f"{s.spec_decode_num_accepted_tokens}/{s.spec_decode_num_draft_tokens}"
            print(f"[gpu_draft] {name} depth {depth}: identical {same}, accepted {accepted}")
    return same_everywhere


def main() -> int:
    ok = all([check(name) for name in ("llama", "qwen3", "gpt2")])
    print("[gpu_draft] all identical", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
