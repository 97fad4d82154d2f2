"""The offline API on a tiny random model: seeds, validation, logprobs, stats."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams, SamplingParamsError
from tests.engine.tiny_models import VOCAB, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model("llama", directory)
    return str(directory)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, skip_tokenizer_init=True, seed=0, block_size=4, kv_cache_memory=8 << 20)


def _prompt(rng, n=None):
    return [rng.randrange(VOCAB) for _ in range(n or rng.randint(1, 30))]


def test_seeded_request_is_reproducible_inside_a_batch(llm, model_dir):
    rng = random.Random(0)
    prompt = _prompt(rng, 9)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    [alone] = llm.generate([prompt], params, use_tqdm=False)
    others = [_prompt(rng) for _ in range(50)]
    other_params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([0, 5]),
            max_tokens=rng.randint(1, 30),
            seed=rng.choice([None, rng.randrange(1000)]),
            ignore_eos=True,
        )
        for _ in others
    ]
    batch = llm.generate(
        others[:25] + [prompt] + others[25:],
        other_params[:25] + [params] + other_params[25:],
        use_tqdm=False,
    )
    assert batch[25].outputs[0].token_ids == alone.outputs[0].token_ids
    # ... and under preemption (recomputation), with a fresh engine and a tiny KV cache.
    small = LLM(
        model_dir,
        skip_tokenizer_init=True,
        seed=99,
        block_size=4,
        max_model_len=64,
        kv_cache_memory=_budget(llm, 64 // 4 + 3),
    )
    again = small.generate(
        others[:25] + [prompt] + others[25:],
        other_params[:25] + [params] + other_params[25:],
        use_tqdm=False,
    )
    assert small.stats().num_preemptions > 0
    assert again[25].outputs[0].token_ids == alone.outputs[0].token_ids
    different = llm.generate([prompt], params.with_updates(seed=4321), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone.outputs[0].token_ids


def _budget(llm, num_blocks):
    from engine.worker.kv_cache import block_bytes

    return block_bytes(llm.config.model, 4) * num_blocks


def test_outputs_come_back_in_input_order_for_every_prompt_form(llm):
    rng = random.Random(1)
    prompts = [_prompt(rng) for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    single = llm.generate(prompts[2], params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    per_prompt = llm.generate(
        prompts[:2], [params, params.with_updates(max_tokens=2)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [5, 2]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(top_k=-5), "top_k"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(logprobs=100), "logprobs"),
        (lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_params_raise_naming_the_field(bad, field):
    with pytest.raises(SamplingParamsError, match=field):
        bad()


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    rng = random.Random(2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    good = [_prompt(rng) for _ in range(3)]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, params, use_tqdm=False)]
    for i, p in enumerate(good):
        engine.add_request(f"good-{i}", p, params)
    engine.step()
    max_len = llm.config.model.max_model_len
    bad_requests = [
        ([1] * max_len, params, "max_model_len"),
        ([], params, "empty"),
        ([VOCAB + 3], params, "token ids"),
        ([1, 2], SamplingParams(logit_bias={VOCAB + 1: 1.0}), "logit_bias"),
        ([1, 2], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        ("text", params, "tokenizer"),
        ([1, 2], SamplingParams(stop=["x"]), "stop strings"),
    ]
    for prompt, p, message in bad_requests:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, p)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("good-0", good[0], params)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([good[0], [1] * max_len], params, use_tqdm=False)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert [finished[f"good-{i}"] for i in range(3)] == expected
    engine.check_integrity()


def test_over_long_prompt_error_names_both_numbers(llm):
    max_len = llm.config.model.max_model_len
    with pytest.raises(ValueError) as info:
        llm.generate([[1] * (max_len + 5)], use_tqdm=False)
    assert f"{max_len + 5:,} tokens" in str(info.value) and f"{max_len:,}" in str(info.value)


def test_generation_stops_at_the_context_length(model_dir):
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=20, kv_cache_memory=1 << 20)
    [out] = llm.generate(
        [[5] * 15], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_prompt_logprobs_are_the_same_chunked_or_not(model_dir):
    rng = random.Random(3)
    prompts = [_prompt(rng, 25), _prompt(rng, 9)]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=2)
    whole = LLM(model_dir, skip_tokenizer_init=True, kv_cache_memory=1 << 20)
    chunked = LLM(
        model_dir, skip_tokenizer_init=True, kv_cache_memory=1 << 20, max_num_batched_tokens=4
    )
    a = whole.generate(prompts, params, use_tqdm=False)
    b = chunked.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert len(x.prompt_logprobs) == len(x.prompt_token_ids)
        assert x.prompt_logprobs[0] is None and y.prompt_logprobs[0] is None
        for ex, ey in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            assert ex.keys() == ey.keys()
            for k in ex:
                assert ex[k].logprob == pytest.approx(ey[k].logprob, abs=1e-4)
        assert x.outputs[0].token_ids == y.outputs[0].token_ids


def test_stats_report_blocks_and_utilization(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate([[3] * 17, [4] * 40], params, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks
    assert 0.8 < stats.mean_kv_slot_utilization <= 1.0
    assert stats.num_steps > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_transformers(model_dir, dtype):
    import torch

    from tests.engine.tiny_models import build_hf_model, hf_greedy

    llm = LLM(model_dir, skip_tokenizer_init=True, dtype=dtype, kv_cache_memory=1 << 20)
    assert llm.engine.worker.runner.kv_cache[0][0].dtype == getattr(torch, dtype)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf_model = build_hf_model("llama").to(getattr(torch, dtype))
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs[0].token_ids) == 10
        # Rounding differs from transformers' kernels, so only the first tokens must agree.
        assert out.outputs[0].token_ids[:4] == hf_greedy(hf_model, prompt, 4)


@pytest.mark.timeout(120)
def test_max_tokens_per_request_reaches_the_limits_and_bounds_a_request(model_dir):
    with pytest.raises(ValueError, match="max_tokens_per_request must be an int >= 1"):
        LLM(model_dir, skip_tokenizer_init=True, max_tokens_per_request=0)
    llm = LLM(
        model_dir, skip_tokenizer_init=True, kv_cache_memory=1 << 20, max_tokens_per_request=64
    )
    assert llm.engine.processor.limits.max_tokens_per_request == 64
    with pytest.raises(ValueError, match=r"n × max_tokens = 2 × 40 = 80 .* of 64; lower n"):
        llm.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=40), use_tqdm=False)
    params = SamplingParams(n=2, max_tokens=32, ignore_eos=True)
    [out] = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [32, 32]
    llm.engine.check_integrity()
