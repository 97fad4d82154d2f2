"""Beam search served: the EngineCore (planning one step ahead, block tables on the
ledger, a worker that keeps its own tokens) returns the offline engine's beams, also
when groups are preempted (recomputed or swapped) while their offers are in flight."""

from __future__ import annotations

import random

import pytest

from engine import LLM, EngineArgs, SamplingParams
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from tests.engine.pipelined import BS, add_all, run_pipelined, served_parts
from tests.engine.pipelined import swap_engine_kwargs as swap_kwargs
from tests.engine.tiny_models import VOCAB, save_hf_model

MAX_LEN = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-served-beams")
    save_hf_model("llama", directory)
    return str(directory)


def engine_kwargs(model_dir: str, num_blocks: int, swap_blocks: int = 0, **overrides) -> dict:
    """test_swap's engine with a longer context, smaller steps and prefix caching on."""
    more = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    return swap_kwargs(model_dir, num_blocks, swap_blocks, MAX_LEN, **more, **overrides)


def count_forks_off_device(monkeypatch) -> list[str]:
    """Records the beams forked from a parent that was not running (preempted or swapped
    out while planning ahead)."""
    seen: list[str] = []
    add_fork = Scheduler.add_fork

    def spy(self, request, parent):
        if parent.status != RequestStatus.RUNNING:
            seen.append(request.request_id)
        add_fork(self, request, parent)

    monkeypatch.setattr(Scheduler, "add_fork", spy)
    return seen


def workload(llm: LLM):
    """Beam searches of widths 1-4 beside sampled requests; two of them end on a stop
    token the model's greedy continuation of their prompt reaches early."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 13))] for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    likely = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    params = [
        SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0, max_tokens=12),
        SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True),
        SamplingParams(
            use_beam_search=True,
            n=3,
            temperature=0,
            max_tokens=10,
            stop_token_ids=[likely[2][2]],
        ),
        SamplingParams(use_beam_search=True, n=1, temperature=0, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(
            use_beam_search=True,
            n=2,
            temperature=0,
            max_tokens=12,
            length_penalty=0.5,
            early_stopping=True,
            stop_token_ids=[likely[5][3], likely[5][5]],
        ),
        SamplingParams(temperature=1.0, seed=2, max_tokens=18, ignore_eos=True),
        SamplingParams(use_beam_search=True, n=4, temperature=0, max_tokens=8),
    ]
    return prompts, params


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("memory", ["plenty", "recompute", "swap"])
def test_core_beams_equal_offline(model_dir, depth, memory, monkeypatch):
    forks_off_device = count_forks_off_device(monkeypatch)
    llm = LLM(model_dir, **engine_kwargs(model_dir, 600))
    prompts, params = workload(llm)
    expected = llm.generate(prompts, params, use_tqdm=False)
    tight = max(  # the least a beam search may be admitted with: beams never share
        sp.beam_width * -(-(len(p) + sp.max_tokens) // BS)
        for p, sp in zip(prompts, params, strict=True)
        if sp.use_beam_search
    )
    blocks_, swap = {"plenty": (600, 0), "recompute": (tight, 0), "swap": (tight, 64)}[memory]
    args = EngineArgs(model=model_dir, **engine_kwargs(model_dir, blocks_, swap))
    parts, worker = served_parts(args)
    core, blocks = parts.core, parts.block_manager
    add_all(core, prompts, params)
    ranked: dict = {}
    sampled, _ = run_pipelined(parts, worker, depth, ranked)

    for i, (want, sp) in enumerate(zip(expected, params, strict=True)):
        if not sp.use_beam_search:
            assert sampled[f"r{i}"] == want.outputs[0].token_ids
            continue
        got = ranked[f"r{i}"]
        assert [s.index for s in got] == list(range(sp.n))
        assert [list(s.token_ids) for s in got] == [c.token_ids for c in want.outputs]
        assert [s.finish_reason for s in got] == [c.finish_reason for c in want.outputs]
        assert [s.score for s in got] == pytest.approx([c.beam_score for c in want.outputs])
    finishes = {s.finish_reason for seqs in ranked.values() for s in seqs}
    assert finishes == {"stop", "length"}
    if memory != "plenty":
        assert core.scheduler.num_preemptions > 0
    if memory == "swap":
        assert core.scheduler.num_swaps > 0
    if memory == "swap" and depth == 2:  # a group swapped out while its offers were in
        assert forks_off_device  # flight forked then: those forks were recomputed
    core.scheduler.check_integrity()
    blocks.check_integrity()
    assert blocks.num_free_blocks == blocks.num_blocks == core.blocks.num_free_blocks
    assert blocks.kv_cache.num_swapped_blocks == 0
    assert not worker.requests and not core.has_unfinished


def test_beam_search_that_cannot_fit_the_cache_is_refused(model_dir):
    """A beam group runs, and is preempted, as one unit with a block table per beam: one
    that could outgrow the whole cache is refused up front instead of waiting forever."""
    llm = LLM(model_dir, **engine_kwargs(model_dir, 12))  # 12 blocks of 4 tokens
    fits = SamplingParams(use_beam_search=True, n=4, temperature=0, max_tokens=7)
    [out] = llm.generate([[1] * 5], fits, use_tqdm=False)  # 4 beams x 3 blocks
    assert len(out.outputs) == 4
    too_big = SamplingParams(use_beam_search=True, n=4, temperature=0, max_tokens=8)
    with pytest.raises(
        ValueError, match=r"best_of .* is 4: that many beams of up to 13 tokens need 16 KV"
    ):
        llm.generate([[1] * 5], too_big, use_tqdm=False)
    capped = LLM(model_dir, **engine_kwargs(model_dir, 600), max_num_seqs=2)
    with pytest.raises(ValueError, match=r"best_of .* must be <= max_num_seqs \(2\)"):
        capped.generate([[1] * 5], fits, use_tqdm=False)
