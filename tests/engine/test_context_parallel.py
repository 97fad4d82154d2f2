"""Context parallelism end to end, offline: `LLM(context_parallel_size=2)` splits each
step's tokens over two ranks (processes over gloo), cutting through long prompts; every
attention layer gathers the shards' K/V, so each rank's cache holds every token and the
outputs are one device's, through preemption, prefix caching, n > 1, beam search,
seeded sampling, logprobs and prompt logprobs."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.parallel.context import ContextParallel
from tests.engine.test_tensor_parallel import _run, live_children
from tests.engine.tiny_models import save_hf_model

FAMILIES = ["llama", "qwen3", "gpt2", "opt", "mixtral"]
LONG = [(5 * i + 2) % 90 + 1 for i in range(45)]  # longer than a step's shard


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", FAMILIES)
def test_two_context_parallel_ranks_give_what_one_device_gives(name, tmp_path):
    save_hf_model(name, tmp_path)
    one, _ = _run(str(tmp_path), 1)
    split, info = _run(str(tmp_path), 1, context_parallel_size=2)
    assert split == one
    assert info["stats"].num_preemptions > 0 and info["stats"].prefix_cache_hit_tokens > 0
    assert info["rank_checks"] > 10
    assert not live_children()


@pytest.mark.timeout(240)
def test_a_long_prompt_prefilled_by_two_ranks_matches_one_device(tmp_path):
    """One 45-token prompt in one step: each rank computes a shard of it, attending to
    keys the other computed; its prompt logprobs and greedy tokens are one device's."""
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=2, logprobs=1)
    results = {}
    for cp in (1, 2):
        with LLM(
            str(tmp_path),
            context_parallel_size=cp,
            skip_tokenizer_init=True,
            max_model_len=96,
            kv_cache_memory=8 << 20,
        ) as llm:
            [out] = llm.generate([LONG], params, use_tqdm=False)
        results[cp] = out
    one, two = results[1], results[2]
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert not live_children()


def test_shards_cover_the_step_in_order():
    for tokens, size in [(7, 2), (45, 2), (10, 3), (3, 3)]:
        bounds = ContextParallel(0, size).bounds(tokens)
        assert bounds[0][0] == 0 and bounds[-1][1] == tokens
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    assert not ContextParallel(0, 4).splits(3) and ContextParallel(0, 4).splits(4)


@pytest.mark.timeout(60)
def test_what_cannot_split_by_tokens_is_refused_by_name(tmp_path):
    save_hf_model("gemma2", tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"context_parallel_size=2: Gemma2ForCausalLM"):
        LLM(str(tmp_path / "gemma2"), context_parallel_size=2, skip_tokenizer_init=True)
    save_hf_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="context_parallel_size > 1 runs alone"):
        LLM(
            str(tmp_path / "llama"),
            context_parallel_size=2,
            tensor_parallel_size=2,
            skip_tokenizer_init=True,
        )
    assert not live_children()
