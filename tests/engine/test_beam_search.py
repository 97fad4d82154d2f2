"""Beam search in the engine against transformers' `generate(num_beams=...)` on the same
weights: the same sequences, the same scores; beams fork and end on shared blocks."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as hf

from engine import LLM, SamplingParams, SamplingParamsError
from engine.core.beam_search import BeamSearch
from tests.conftest import shared_path
from tests.engine.tiny_models import hf_beams, kv_memory, save_hf_model

PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [200, 1, 64], list(range(30, 49))]
CASES = [  # (width, length_penalty, early_stopping)
    (1, 1.0, False),
    (2, 1.0, False),
    (4, 1.0, False),
    (4, 0.5, True),
    (2, 2.0, "never"),
]


def ours(llm, prompt, width, length_penalty, early_stopping, max_new):
    params = SamplingParams(
        use_beam_search=True,
        n=width,
        temperature=0,
        max_tokens=max_new,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out


END_TOKEN = 17  # some of the tiny model's best beams end on it


@pytest.fixture(scope="module", params=[None, END_TOKEN], ids=["no-eos", "eos"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-beams")
    model = save_hf_model("llama", directory)
    eos = request.param
    if eos is not None:  # an end token the greedy paths meet
        config = json.loads((directory / "config.json").read_text())
        config["eos_token_id"] = eos
        (directory / "config.json").write_text(json.dumps(config))
    llm = LLM(str(directory), skip_tokenizer_init=True, block_size=4, kv_cache_memory=8 << 20)
    return model, llm, eos


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), CASES)
def test_tiny_llama_beams_equal_transformers(tiny, width, length_penalty, early_stopping):
    model, llm, eos = tiny
    for prompt in PROMPTS:
        want, scores = hf_beams(model, prompt, width, length_penalty, early_stopping, 12, eos)
        out = ours(llm, prompt, width, length_penalty, early_stopping, 12)
        assert [c.token_ids for c in out.outputs] == want
        if scores is not None:
            got = [c.beam_score for c in out.outputs]
            assert got == pytest.approx(scores, abs=1e-4)
    kv = llm.engine.core.scheduler.kv_cache
    llm.engine.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_eos_ends_beams_early(tmp_path):
    save_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": END_TOKEN}))
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, block_size=4, kv_cache_memory=8 << 20)
    finish = [
        c.finish_reason for prompt in PROMPTS for c in ours(llm, prompt, 4, 1.0, False, 12).outputs
    ]
    assert "stop" in finish and "length" in finish


def test_beams_share_blocks_while_they_run(tiny):
    _, llm, _ = tiny
    engine = llm.engine
    params = SamplingParams(use_beam_search=True, n=4, temperature=0, max_tokens=20)
    engine.add_request("b", list(range(40, 55)), params)
    kv = engine.core.scheduler.kv_cache
    peak_shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        tables = [kv.block_table(r.request_id) for r in engine.core.scheduler.running]
        held = sum(len(t) for t in tables)
        owned = kv.num_blocks - kv.num_free_blocks
        peak_shared = max(peak_shared, held - owned)
        engine.check_integrity()
    assert peak_shared >= 3 * 3  # 4 beams hold the prompt's 3 full blocks once
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.shared
@pytest.mark.parametrize("width", [1, 2, 4])
def test_stories260k_beams_equal_transformers(width):
    path = shared_path("models", "stories260K")
    model = hf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), kv_cache_memory=32 << 20)
    tokenizer = llm.get_tokenizer()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    for text in ("Once upon a time", "The little dog"):
        prompt = tokenizer.encode(text)
        want, scores = hf_beams(model, prompt, width, 1.0, False, 30, eos)
        out = ours(llm, prompt, width, 1.0, False, 30)
        assert [c.token_ids for c in out.outputs] == want
        if scores is not None:
            assert [c.beam_score for c in out.outputs] == pytest.approx(scores, abs=1e-4)


def test_beam_search_refuses_sampling_fields():
    with pytest.raises(SamplingParamsError, match="temperature must be 0.0 with use_beam_search"):
        SamplingParams(use_beam_search=True)
    with pytest.raises(SamplingParamsError, match="early_stopping"):
        SamplingParams(early_stopping="sometimes")


def test_search_stops_once_width_hypotheses_exist_with_early_stopping():
    search = BeamSearch(2, 1.0, True, 10, frozenset({0}))
    # beam 0 offers the end token first: two hypotheses after two steps
    beams = search.step([()], [[(0, -0.1), (1, -0.2), (2, -0.3), (3, -0.4)]])
    assert [b.token_id for b in beams] == [1, 2] and len(search.finished) == 1
    search.step([(1,), (2,)], [[(0, -0.1), (5, -0.5)], [(6, -0.1), (0, -0.2)]])
    assert search.done and len(search.finished) == 2


def test_beam_groups_preempted_as_one_unit_match_plenty_of_memory(tmp_path):
    """Beam searches beside other requests under a tiny KV budget: groups are preempted
    (and readmitted) whole, and every result equals the run with memory to spare."""
    save_hf_model("llama", tmp_path)
    base = dict(skip_tokenizer_init=True, block_size=4, max_model_len=48, seed=0)
    per_block = kv_memory(tmp_path, 1, 4)
    beams = SamplingParams(use_beam_search=True, n=2, best_of=3, temperature=0, max_tokens=14)
    others = SamplingParams(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)
    prompts = [PROMPTS[0], [9] * 11, PROMPTS[1], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [beams, others, beams, others]
    runs = {}
    # 18 blocks: the least the width-3 searches are admitted with (each beam may need
    # blocks of its own for up to 21 tokens)
    for name, blocks in (("plenty", 400), ("tight", 18)):
        llm = LLM(str(tmp_path), kv_cache_memory=per_block * blocks, **base)
        outs = run_checking_units(llm, prompts, params)
        runs[name] = [[c.token_ids for c in o.outputs] for o in outs]
        runs[name + " scores"] = [c.beam_score or 0.0 for o in outs for c in o.outputs]
        llm.engine.check_integrity()
        if name == "tight":
            assert llm.stats().num_preemptions > 0
    assert runs["tight"] == runs["plenty"]
    # recomputed KV differs from the first computation in the last float bits only
    assert runs["tight scores"] == pytest.approx(runs["plenty scores"], abs=1e-5)


def run_checking_units(llm, prompts, params):
    """Steps the engine; after every step each beam group's beams are all running or
    all off the device: never split by a preemption."""
    from engine.core.beam_group import BeamGroup
    from engine.core.request import RequestStatus

    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"q{i}", prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
        for group in engine.core._groups.values():
            if isinstance(group, BeamGroup):
                running = {b.status == RequestStatus.RUNNING for b in group.running}
                assert len(running) <= 1, f"{group.request_id}: beams split"
    return [done[f"q{i}"] for i in range(len(prompts))]
