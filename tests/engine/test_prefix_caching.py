"""Automatic prefix caching in the offline engine: identical outputs with it on and off,
a chat's next turn computes only its new tokens, eviction under memory pressure, and
prompt logprobs unaffected."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.conftest import shared_path
from tests.engine.tiny_models import VOCAB, kv_memory, save_hf_model

BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-prefix")
    save_hf_model("llama", directory)
    return str(directory)


def make_llm(model_dir: str, caching: bool, num_blocks: int = 512, **kw) -> LLM:
    budget = kv_memory(model_dir, num_blocks, BS)
    return LLM(
        model_dir,
        skip_tokenizer_init=True,
        block_size=BS,
        kv_cache_memory=budget,
        enable_prefix_caching=caching,
        seed=0,
        **kw,
    )


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix_workload(seed: int = 0):
    """Three system prompts x four user turns, greedy and seeded sampling mixed."""
    rng = random.Random(seed)
    systems = [tokens(rng, n) for n in (13, 20, 9)]
    prompts = [s + tokens(rng, rng.randint(1, 9)) for s in systems for _ in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


def run_chats(llm: LLM, num_turns: int = 3, seed: int = 1) -> list[list[int]]:
    """Three chats in lockstep; each turn's prompt is the previous prompt, its reply
    and a new message. Returns every turn's output token ids."""
    rng = random.Random(seed)
    prompts = [tokens(rng, n) for n in (11, 6, 17)]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    replies = []
    for _ in range(num_turns):
        outs = llm.generate(prompts, params, use_tqdm=False)
        replies += [o.outputs[0].token_ids for o in outs]
        prompts = [
            p + o.outputs[0].token_ids + tokens(rng, rng.randint(2, 6))
            for p, o in zip(prompts, outs, strict=True)
        ]
    return replies


def outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_outputs_identical_with_caching_on_and_off(model_dir) -> None:
    prompts, params = shared_prefix_workload()
    on, off = make_llm(model_dir, True), make_llm(model_dir, False)
    # the first batch fills the cache, the second one hits it
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    assert run_chats(on) == run_chats(off)
    stats = on.stats()
    assert stats.prefix_cache_hit_tokens > 0 and 0 < stats.prefix_cache_hit_rate < 1
    assert off.stats().prefix_cache_hit_tokens == 0
    for llm in (on, off):
        llm.engine.check_integrity()


def test_a_chats_next_turn_computes_only_its_new_tokens(model_dir) -> None:
    llm = make_llm(model_dir, True)
    rng = random.Random(5)
    turn1 = tokens(rng, 18)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    [out] = llm.generate([turn1], params, use_tqdm=False)
    reply = out.outputs[0].token_ids
    new = tokens(rng, 5)
    turn2 = turn1 + reply + new
    before = llm.stats().prefix_cache_hit_tokens
    llm.generate([turn2], params, use_tqdm=False)
    hit = llm.stats().prefix_cache_hit_tokens - before
    # turn 1 computed its prompt and all but its last reply token; every full block of
    # that is reused, so turn 2 computes the new message plus less than one block
    assert hit == (len(turn1) + len(reply) - 1) // BS * BS
    assert len(turn2) - hit < len(new) + BS + 1
    llm.engine.check_integrity()


def test_eviction_under_memory_pressure_keeps_outputs_identical(model_dir) -> None:
    prompts, params = shared_prefix_workload(seed=2)
    rng = random.Random(9)
    others = [tokens(rng, 30) for _ in range(6)]  # push the shared blocks out
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plenty = make_llm(model_dir, False)
    tight = make_llm(model_dir, True, num_blocks=40, max_num_seqs=2)
    for llm in (plenty, tight):
        llm.result = outputs(llm, prompts, params) + outputs(llm, others, [greedy] * 6)
        llm.result += outputs(llm, prompts, params)
    assert tight.result == plenty.result
    stats = tight.stats()
    assert stats.num_cache_evictions > 0 and stats.prefix_cache_hit_tokens > 0
    tight.engine.check_integrity()


def test_prompt_logprobs_are_computed_in_full_even_when_cached(model_dir) -> None:
    rng = random.Random(4)
    prompt = tokens(rng, 21)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    on, off = make_llm(model_dir, True), make_llm(model_dir, False)
    on.generate([prompt], plain, use_tqdm=False)  # cache the prompt's blocks
    [a] = on.generate([prompt], scored, use_tqdm=False)
    [b] = off.generate([prompt], scored, use_tqdm=False)
    assert len(a.prompt_logprobs) == len(prompt)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].logprob == pytest.approx(y[k].logprob, abs=1e-5)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_reset_prefix_cache_drops_the_cached_blocks(model_dir) -> None:
    llm = make_llm(model_dir, True)
    prompts, params = shared_prefix_workload(seed=3)
    first = outputs(llm, prompts, params)
    assert llm.stats().num_cached_blocks > 0
    assert llm.reset_prefix_cache() > 0
    assert llm.stats().num_cached_blocks == 0
    before = llm.stats().prefix_cache_hit_tokens
    assert outputs(llm, prompts[:1], params[:1]) == first[:1]
    assert llm.stats().prefix_cache_hit_tokens == before  # nothing left to hit


@pytest.mark.shared
def test_stories260k_with_caching_matches_without() -> None:
    model = str(shared_path("models", "stories260K"))
    on = LLM(model, kv_cache_memory=32 << 20, enable_prefix_caching=True)
    off = LLM(model, kv_cache_memory=32 << 20, enable_prefix_caching=False)
    system = "Once upon a time, there was a little girl named Lily. She loved to play"
    prompts = [f"{system} {tail}" for tail in ("outside.", "with her dog.", "in the park.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    for _ in range(2):
        a = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
        assert a == b
    assert on.stats().prefix_cache_hit_tokens > 0
    on.engine.check_integrity()
