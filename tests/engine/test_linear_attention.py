"""Models with linear-attention layers (Qwen 3.5's and Qwen3-Next's Gated DeltaNet beside
full attention) through the engine, against transformers: states kept in KV cache pages
of a RECURRENT group, across chunked prefill, one step ahead, prefix-cache hits at block
boundaries, swap and recompute preemption, n=2 and beam search."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kv.kv_cache_groups import KVCacheGroupKind
from engine.worker.kv_cache import block_bytes
from tests.engine.tiny_models import VOCAB, hf_beams, hf_greedy, save_hf_model

MAX_NEW, MAX_LEN = 10, 96
PROMPT_LENS = (1, 5, 31, 32, 33, 70)  # around the (raised) block size of 32


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3-next"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, directory)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    return str(directory), hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def engine(directory: str, **kwargs) -> LLM:
    return LLM(directory, skip_tokenizer_init=True, max_model_len=MAX_LEN, seed=0, **kwargs)


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=n)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_the_block_size_is_raised_until_a_page_holds_a_state(model):
    directory, *_ = model
    llm = engine(directory, block_size=8)
    config = llm.config
    assert config.cache.block_size == config.model.min_block_size() > 8
    kinds = [g.kind for g in config.model.kv_cache_layout.groups]
    assert KVCacheGroupKind.RECURRENT in kinds and KVCacheGroupKind.FULL_ATTENTION in kinds


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunks that end mid-block and cross blocks
        {"pipeline_depth": 2, "max_num_batched_tokens": 24},
    ],
    ids=["whole", "chunked", "one-step-ahead"],
)
def test_greedy_tokens_equal_transformers(model, options):
    directory, _, prompts, expected = model
    depth = options.pop("pipeline_depth", 1)
    llm = LLM(
        directory, skip_tokenizer_init=True, max_model_len=MAX_LEN, pipeline_depth=depth, **options
    )
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False)) == expected
    llm.engine.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_hits_resume_from_block_boundary_states_and_n2_keeps_tokens(model, caching):
    directory, _, prompts, expected = model
    llm = engine(directory, enable_prefix_caching=caching)
    for _ in range(2):  # the second pass hits the prefix cache (when on)
        outs = llm.generate(prompts, greedy(n=2), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
        llm.engine.check_integrity()
    assert (llm.stats().prefix_cache_hit_tokens > 0) == caching


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_transformers_tokens(model, mode):
    directory, _, prompts, expected = model
    probe = engine(directory)
    config = probe.config
    bs = config.cache.block_size
    one = config.model.kv_cache_layout.max_blocks_per_sequence(MAX_LEN, 16, bs)
    per_block = block_bytes(config.model, bs)
    swap = dict(swap_space=per_block * 64 / 1024**3) if mode == "swap" else {}
    llm = engine(
        directory,
        max_num_batched_tokens=16,
        kv_cache_memory=per_block * (one + 2),
        preemption_mode=mode,
        **swap,
    )
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False)) == expected
    llm.engine.check_integrity()
    stats = llm.stats()
    assert (stats.num_swaps if mode == "swap" else stats.num_preemptions) > 0
    assert stats.num_free_blocks == stats.num_blocks


def test_beam_search_equals_transformers(model):
    directory, hf, prompts, _ = model
    llm = engine(directory)
    params = SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=MAX_NEW)
    for prompt in (prompts[1], prompts[-1]):
        want, scores = hf_beams(hf, prompt, 2, 1.0, False, MAX_NEW)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == want
        assert [c.beam_score for c in out.outputs] == pytest.approx(scores, abs=1e-4)
    llm.engine.check_integrity()


@pytest.mark.parametrize("chunk", [16, 96])
def test_beams_preempted_come_back_in_a_cache_sized_for_their_recompute(model, chunk):
    """A beam group is readmitted as one unit, each beam recomputing chunk by chunk, so
    its pages peak at a chunk's span per group per beam (more than decoding needs). The
    request check counts that peak: a cache one page short refuses the beams up front,
    and one that holds them runs them, preempted by greedy requests beside them, to
    transformers' beams (this once deadlocked: nothing running, the group waiting)."""
    directory, hf, prompts, expected = model
    config = engine(directory).config
    bs, layout = config.cache.block_size, config.model.kv_cache_layout
    per_block = block_bytes(config.model, bs)
    need = 2 * layout.max_blocks_per_sequence(len(prompts[-1]) + MAX_NEW, chunk, bs)
    params = SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=MAX_NEW)
    options = dict(max_num_batched_tokens=chunk, preemption_mode="recompute")
    short = engine(directory, kv_cache_memory=per_block * need, **options)  # less the null page
    with pytest.raises(ValueError, match=r"best_of \(the beam width.*need \d+ KV cache blocks"):
        short.generate([prompts[-1]], params, use_tqdm=False)
    llm = engine(directory, kv_cache_memory=per_block * (need + 1), **options)
    others = [5, 4, 3]
    outs = llm.generate(
        [prompts[-1]] + [prompts[i] for i in others], [params] + [greedy()] * 3, use_tqdm=False
    )
    want, _ = hf_beams(hf, prompts[-1], 2, 1.0, False, MAX_NEW)
    assert [c.token_ids for c in outs[0].outputs] == want
    assert tokens(outs[1:]) == [expected[i] for i in others]
    llm.engine.check_integrity()
    assert llm.stats().num_preemptions > 0
