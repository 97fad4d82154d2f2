"""The families with sliding windows, sinks, soft caps or experts against transformers
through every KV path at once: swap preemption in a tight cache, prefix-cache hits (a
second pass over the same prompts), caching off, n=2 and beam search; prompts shorter
and longer than the windows (test_hf_parity.py runs their block sizes, chunked prefill
and recompute preemption)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.worker.kv_cache import block_bytes
from tests.engine.tiny_models import VOCAB, hf_beams, hf_greedy, save_hf_model

FAMILIES = [
    "mistral-window",
    "qwen2-hybrid",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt-oss",
    "mixtral",
    "qwen3-moe",
]
MAX_NEW, BS, MAX_LEN = 10, 4, 64
PROMPT_LENS = (2, 5, 9, 17, 30, 40)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, directory)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    return str(directory), model, prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


def tight_llm(directory: str, **kwargs) -> LLM:
    """Swap preemption in a cache that holds about one sequence at a time."""
    probe = LLM(directory, skip_tokenizer_init=True, max_model_len=MAX_LEN, block_size=BS)
    model = probe.config.model
    one = model.kv_cache_layout.max_blocks_per_sequence(MAX_LEN, 16, BS)
    per_block = block_bytes(model, BS)
    return LLM(
        directory,
        skip_tokenizer_init=True,
        block_size=BS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=16,
        kv_cache_memory=per_block * (one + 3),
        swap_space=per_block * 64 / 1024**3,
        preemption_mode="swap",
        seed=0,
        **kwargs,
    )


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=n)


def test_swap_preemption_keeps_transformers_tokens(family):
    directory, _, prompts, expected = family
    llm = tight_llm(directory)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.engine.check_integrity()
    stats = llm.stats()
    assert stats.num_swaps > 0 and stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off_and_two_samples_keep_transformers_tokens(family, caching):
    directory, _, prompts, expected = family
    llm = LLM(
        directory,
        skip_tokenizer_init=True,
        block_size=BS,
        max_model_len=MAX_LEN,
        enable_prefix_caching=caching,
    )
    for _ in range(2):  # the second pass hits the prefix cache (when on)
        outs = llm.generate(prompts, greedy(n=2), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
        llm.engine.check_integrity()
    assert (llm.stats().prefix_cache_hit_tokens > 0) == caching


def test_beam_search_equals_transformers(family):
    directory, model, prompts, _ = family
    llm = LLM(directory, skip_tokenizer_init=True, block_size=BS, max_model_len=MAX_LEN)
    params = SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=MAX_NEW)
    for prompt in (prompts[1], prompts[-1]):  # within and past the windows
        want, scores = hf_beams(model, prompt, 2, 1.0, False, MAX_NEW)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == want
        assert [c.beam_score for c in out.outputs] == pytest.approx(scores, abs=1e-4)
    llm.engine.check_integrity()
