"""Tensor parallelism end to end, offline: `LLM(tensor_parallel_size=2)` (rank 0
here, rank 1 a process of its own, gloo between them) gives exactly what one device
gives, for every architecture and stories260K, through preemption (recompute and swap),
prefix caching, n > 1, beam search and seeded sampling; the ranks' block tables agree
at every step (the worker compares their digests, `Worker.num_rank_checks`)."""

from __future__ import annotations

import json
import os

import pytest

from engine.engine_args import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.kv_cache import reserved_blocks
from tests.conftest import shared_path
from tests.engine.tiny_models import ARCHITECTURES, kv_memory, save_hf_model
from tests.web.processes import alive, children_of

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # on every rank: tight enough that the batch below preempts
SHARED_PREFIX = [7, 3, 9, 12, 30, 41, 5, 6]  # two full blocks every prompt shares

PROMPTS = [SHARED_PREFIX + tail for tail in ([1, 2], [3], [4, 5, 6], [8], [10, 11], [2])]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=16, n=2, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=16, n=2, use_beam_search=True, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
]


def live_children() -> list[int]:
    """This process's children that still run (not yet reaped zombies excluded)."""
    return [pid for pid in children_of(os.getpid()) if alive(pid)]


def _cache_size(model_dir: str) -> tuple[int, int]:
    """(block size, blocks): BLOCK_SIZE, or what the engine raises it to (a linear-
    attention state per page); NUM_BLOCKS, or for a hybrid KV layout, whose windowed
    groups free blocks as sequences pass their windows (so 24 may never preempt, or may
    not hold one sequence across several groups): what one 64-token sequence needs, the
    allocator's reserved block and one more; with linear-attention groups, room for the
    beam search's two sequences of up to 64 tokens, each recomputing in one chunk after
    a preemption."""
    args = EngineArgs(
        model=model_dir, skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=64
    )
    config = args.build()
    block_size, model = config.cache.block_size, config.model
    layout = model.kv_cache_layout
    if not layout.is_hybrid:
        return block_size, NUM_BLOCKS
    sequences = 2 if layout.recurrent_layers else 1
    one = layout.max_blocks_per_sequence(64, 64, block_size)
    return block_size, sequences * one + reserved_blocks(model) + 1


def _run(model_dir: str, tp: int, prompts=PROMPTS, pp: int = 1, **kwargs) -> tuple[list, dict]:
    block_size, num_blocks = _cache_size(model_dir)
    dtype = kwargs.get("kv_cache_dtype", "auto")
    memory = kv_memory(model_dir, num_blocks, block_size, tp, dtype, pipeline_parallel_size=pp)
    with LLM(
        model_dir,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        skip_tokenizer_init=True,
        block_size=block_size,
        kv_cache_memory=memory,
        max_model_len=64,
        max_num_seqs=8,
        **kwargs,
    ) as llm:
        outs = llm.generate(prompts[:1], PARAMS[:1], use_tqdm=False)  # caches the prefix
        outs += llm.generate(prompts, PARAMS, use_tqdm=False)
        stats = llm.stats()
        llm.engine.check_integrity()
        checks = getattr(llm.engine.worker, "worker", llm.engine.worker).num_rank_checks
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
    return tokens, {"stats": stats, "rank_checks": checks}


def _assert_same_as_one_device(model_dir: str, **kwargs) -> None:
    one, one_info = _run(model_dir, 1, **kwargs)
    two, two_info = _run(model_dir, 2, **kwargs)
    assert two == one
    assert two_info["stats"].num_preemptions > 0  # the scenario did preempt
    assert two_info["stats"].prefix_cache_hit_tokens > 0
    assert two_info["rank_checks"] > 10 and one_info["rank_checks"] == 0
    assert not live_children()


# Linear-attention models' pages hold a state, so their blocks are 32 tokens: prompts
# sharing a whole block (and short enough for 24 more tokens in 64).
LINEAR_ATTENTION = {"qwen3.5", "qwen3-next"}
LONG_PREFIX = [(7 * i + 3) % 50 for i in range(34)]
LONG_PROMPTS = [LONG_PREFIX + p[len(SHARED_PREFIX) :] for p in PROMPTS]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, directory)
    return request.param, str(directory)


@pytest.mark.timeout(240)
def test_two_ranks_give_what_one_device_gives(checkpoint):
    name, model_dir = checkpoint
    prompts = LONG_PROMPTS if name in LINEAR_ATTENTION else PROMPTS
    _assert_same_as_one_device(model_dir, prompts=prompts)


@pytest.mark.timeout(240)
def test_two_ranks_swap_as_one_device_does(tmp_path):
    save_hf_model("llama", tmp_path)
    _assert_same_as_one_device(str(tmp_path), swap_space=0.01, preemption_mode="swap")


@pytest.mark.timeout(240)
def test_two_ranks_with_an_int8_cache_give_what_one_device_gives(tmp_path):
    """Each rank codes its own heads' rows (a scale per token and head): the same codes."""
    save_hf_model("qwen3", tmp_path)
    _assert_same_as_one_device(str(tmp_path), kv_cache_dtype="int8")


@pytest.mark.shared
@pytest.mark.timeout(240)
def test_stories260k_on_two_ranks():
    _assert_same_as_one_device(str(shared_path("models", "stories260K")))


def test_a_model_the_ranks_cannot_split_is_refused_by_name(tmp_path):
    save_hf_model("gpt2", tmp_path)  # 4 heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) does not split evenly"):
        LLM(str(tmp_path), tensor_parallel_size=3, skip_tokenizer_init=True)
    assert not live_children()  # refused before any rank started


def test_linear_attention_heads_that_do_not_split_are_refused_by_name(tmp_path):
    save_hf_model("qwen3.5", tmp_path)  # 2 key heads over 4 ranks
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) does not split evenly"):
        LLM(str(tmp_path), tensor_parallel_size=4, skip_tokenizer_init=True)
    assert not live_children()


def test_tensor_parallel_size_is_range_checked(tmp_path):
    save_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer in \[1, 64\]"):
        LLM(str(tmp_path), tensor_parallel_size=0, skip_tokenizer_init=True)


@pytest.mark.timeout(240)
def test_structured_outputs_on_two_ranks_match_one_device():
    """Rank 0 samples under the grammar's mask and broadcasts the token: two ranks give
    one device's valid outputs, greedy and seeded n=2, beside an unconstrained request."""
    from engine.structured_outputs import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 9},
            "c": {"enum": ["a", "b"]},
        },
        "required": ["x", "c"],
    }
    grammar = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    ascii_only = {b: -100.0 for b in range(0x80, 0x100)}
    params = [
        SamplingParams(
            temperature=0, max_tokens=64, structured_outputs=grammar, logit_bias=ascii_only
        ),
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=3,
            max_tokens=64,
            structured_outputs=grammar,
            logit_bias=ascii_only,
        ),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    texts = {}
    for tp in (1, 2):
        with LLM("builtin:tiny", tensor_parallel_size=tp, kv_cache_memory=16 << 20, seed=0) as llm:
            outs = llm.generate(["Q: a point. A:"] * 3, params, use_tqdm=False)
        texts[tp] = [[c.text for c in o.outputs] for o in outs]
    assert texts[2] == texts[1]
    for text in [t for o in texts[2][:2] for t in o]:
        value = json.loads(text)
        assert 0 <= value["x"] <= 9 and value["c"] in ("a", "b"), text
    assert not live_children()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "gpt-oss"])
def test_expert_parallel_ranks_give_what_one_device_gives(name, tmp_path):
    """`enable_expert_parallel`: each of two ranks holds half the experts, whole (their
    gate/up/down unsliced), and the same tokens come out as on one device."""
    save_hf_model(name, tmp_path)
    one, _ = _run(str(tmp_path), 1)
    two, info = _run(str(tmp_path), 2, enable_expert_parallel=True)
    assert two == one
    assert info["stats"].num_preemptions > 0 and info["rank_checks"] > 10
    with LLM(
        str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, skip_tokenizer_init=True
    ) as llm:
        llm.generate(PROMPTS[:2], PARAMS[0], use_tqdm=False)
        model = getattr(llm.engine.worker, "worker", llm.engine.worker).runner.model
        layers = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
        experts = layers[0].num_experts
        assert layers[0].local_experts == range(0, experts // 2)  # rank 0's share
        assert layers[0].intermediate.size == layers[0].intermediate.full  # not sliced
        load = llm.expert_load()  # per layer, every expert's assignments so far
        assert len(load) == len(layers) and all(len(row) == experts for row in load)
        top_k = layers[0].top_k
        assert all(sum(row) % top_k == 0 and sum(row) > 0 for row in load)
    assert not live_children()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "gpt-oss"])
def test_experts_reached_by_all_to_all_give_what_one_device_gives(name, tmp_path):
    """`expert_dispatch="all_to_all"`: each rank sends its half of the tokens to the
    experts' ranks and back (uneven shares, steps of one token included)."""
    save_hf_model(name, tmp_path)
    one, _ = _run(str(tmp_path), 1)
    two, info = _run(str(tmp_path), 2, enable_expert_parallel=True, expert_dispatch="all_to_all")
    assert two == one
    assert info["stats"].num_preemptions > 0 and info["rank_checks"] > 10
    assert not live_children()


def test_expert_dispatch_is_checked(tmp_path):
    save_hf_model("mixtral", tmp_path)
    with pytest.raises(ValueError, match=r"expert_dispatch must be one of \('all_reduce'"):
        LLM(str(tmp_path), expert_dispatch="ring", skip_tokenizer_init=True)


def test_expert_parallel_without_experts_is_refused_by_name(tmp_path):
    save_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        LLM(str(tmp_path), enable_expert_parallel=True, skip_tokenizer_init=True)
