"""Parallel sampling (`n`, `best_of`): sequences of one request share the prompt's
blocks, and each samples exactly what its seed samples alone."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams, SamplingParamsError
from engine.messages import sequence_id
from tests.engine.tiny_models import VOCAB, kv_memory, save_hf_model

BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-parallel")
    save_hf_model("llama", directory)
    return str(directory)


def make_llm(model_dir: str, num_blocks: int = 512, **kw) -> LLM:
    budget = kv_memory(model_dir, num_blocks, BS)
    kw = {"enable_prefix_caching": False, **kw}
    return LLM(model_dir, skip_tokenizer_init=True, block_size=BS, kv_cache_memory=budget, **kw)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def alone(llm: LLM, tokens: list[int], params: SamplingParams) -> list[int]:
    [out] = llm.generate([tokens], params, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("length", [9, 12])  # last prompt block partial / full
def test_n_seeded_samples_equal_their_seeds_alone_and_share_the_prompt(model_dir, length):
    llm = make_llm(model_dir)
    tokens = prompt(1, length)
    params = SamplingParams(n=4, temperature=1.0, seed=100, max_tokens=10, ignore_eos=True)
    engine = llm.engine
    engine.add_request("g", tokens, params)
    kv = engine.core.scheduler.kv_cache
    ids = [sequence_id("g", i) for i in range(4)]
    engine.step()  # the leader computes the prompt alone
    assert kv.num_free_blocks == kv.num_blocks - -(-length // BS)
    engine.step()  # the others join, forking the prompt's blocks
    tables = [kv.block_table(s) for s in ids]
    shared = (length - 1) // BS  # the block holding the last prompt token is copied
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert all(kv.pool.ref_count(b) == 4 for b in tables[0][:shared])
    assert len({t[shared] for t in tables}) == 4
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [out] = outputs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for i, completion in enumerate(out.outputs):
        expected = alone(llm, tokens, params.with_updates(n=1, seed=100 + i))
        assert completion.token_ids == expected
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    engine.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_greedy_samples_are_identical(model_dir):
    llm = make_llm(model_dir)
    tokens = prompt(2, 7)
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate([tokens], params, use_tqdm=False)
    expected = alone(llm, tokens, params.with_updates(n=1))
    assert [c.token_ids for c in out.outputs] == [expected] * 3


def test_best_of_returns_the_n_best_by_cumulative_logprob(model_dir):
    llm = make_llm(model_dir)
    tokens = prompt(3, 10)
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=6)
    [out] = llm.generate([tokens], params, use_tqdm=False)
    runs = []
    for i in range(5):
        one = params.with_updates(n=1, best_of=None, seed=7 + i, logprobs=0)
        [r] = llm.generate([tokens], one, use_tqdm=False)
        runs.append((r.outputs[0].cumulative_logprob, r.outputs[0].token_ids))
    runs.sort(key=lambda r: r[0], reverse=True)
    assert [c.token_ids for c in out.outputs] == [t for _, t in runs[:2]]
    for c, (lp, _) in zip(out.outputs, runs, strict=False):
        assert c.cumulative_logprob == pytest.approx(lp, abs=1e-4)
        assert c.logprobs is None  # not asked for


def test_parallel_sampling_under_preemption_matches_plenty_of_memory(model_dir):
    prompts = [prompt(10 + i, 6 + 3 * i) for i in range(5)]
    params = [
        SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(5)
    ]
    plenty = make_llm(model_dir).generate(prompts, params, use_tqdm=False)
    tight_llm = make_llm(model_dir, num_blocks=24, enable_prefix_caching=True, max_model_len=40)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plenty, tight, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert tight_llm.stats().num_preemptions > 0
    tight_llm.engine.check_integrity()


def test_aborting_a_group_frees_every_sequence(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True)
    engine.add_request("g", prompt(4, 11), params)
    for _ in range(3):
        engine.step()
    out = engine.abort_request("g")
    assert out is not None and len(out.outputs) == 3
    assert all(c.finish_reason == "abort" for c in out.outputs)
    assert not engine.has_unfinished_requests()
    kv = engine.core.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("h", [1, 2], SamplingParams(n=2))
        engine.add_request(sequence_id("h", 1), [1, 2], SamplingParams())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 2, "best_of": 1}, "best_of must be an int in \\[2, 256\\]"),
        ({"n": 0}, "n must be an int in \\[1, 256\\]"),
        ({"n": 257}, "n must be an int in \\[1, 256\\]"),
    ],
)
def test_invalid_sequence_counts_name_the_field(fields, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**fields)


def test_stats_report_the_memory_saved_by_sharing(model_dir):
    single = make_llm(model_dir)
    tokens = prompt(5, 40)
    single.generate([tokens], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert single.stats().mean_kv_sharing_saving == 0.0
    shared = make_llm(model_dir)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    shared.generate([tokens], params, use_tqdm=False)
    # 4 sequences of 40 to 48 tokens hold 4 x 10 to 4 x 12 blocks; the prompt's first 9
    # blocks are stored once (its 10th holds the last prompt token: each copies it), so
    # 27 of 40 to 48 blocks are saved while all 4 run, none in the leader's first step
    saving = shared.stats().mean_kv_sharing_saving
    assert 0.4 < saving < 27 / 40
