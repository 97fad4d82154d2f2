"""Pipeline parallelism end to end, offline: `LLM(pipeline_parallel_size=2)` (and with
`tensor_parallel_size=2`, four ranks) splits the layers into stages on gloo and gives
exactly what one device gives, through preemption (recompute and swap), prefix caching,
n > 1, beam search and seeded sampling, with the ranks' block tables checked to agree at
every step. Each stage holds and caches its own layers only."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.parallel.pipeline import MissingModule, PipelineStage, split_rows
from tests.conftest import shared_path
from tests.engine.test_tensor_parallel import _run, live_children
from tests.engine.tiny_models import save_hf_model

# The families whose KV cache is one group (every layer attends alike), dense and MoE.
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "mixtral", "qwen3-moe"]


def _assert_same_as_one_device(model_dir: str, tp: int = 1, pp: int = 2, **kwargs) -> None:
    one, _ = _run(model_dir, 1, **kwargs)
    split, info = _run(model_dir, tp, pp=pp, **kwargs)
    assert split == one
    assert info["stats"].num_preemptions > 0  # the scenario did preempt
    assert info["stats"].prefix_cache_hit_tokens > 0
    assert info["rank_checks"] > 10
    assert not live_children()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", FAMILIES)
def test_two_stages_give_what_one_device_gives(name, tmp_path):
    save_hf_model(name, tmp_path)
    _assert_same_as_one_device(str(tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FAMILIES[:6])
def test_two_stages_of_two_tensor_parallel_ranks_give_what_one_device_gives(name, tmp_path):
    """Four processes: each stage a tensor-parallel pair (its own all-reduces)."""
    save_hf_model(name, tmp_path)
    _assert_same_as_one_device(str(tmp_path), tp=2, pp=2)


@pytest.mark.timeout(240)
def test_two_stages_swap_as_one_device_does(tmp_path):
    save_hf_model("llama", tmp_path)
    _assert_same_as_one_device(str(tmp_path), swap_space=0.01, preemption_mode="swap")


@pytest.mark.shared
@pytest.mark.timeout(240)
def test_stories260k_in_two_uneven_stages():
    """Five layers: the first stage holds three, the last two."""
    _assert_same_as_one_device(str(shared_path("models", "stories260K")))


@pytest.mark.timeout(120)
def test_the_sampling_rank_holds_the_last_stage_only(tmp_path):
    """Rank 0 (here) is the last stage: its layers, the final norm and the head, and a
    KV cache for its layers alone; the embedding lives on the other rank."""
    save_hf_model("llama", tmp_path)
    with LLM(str(tmp_path), pipeline_parallel_size=2, skip_tokenizer_init=True) as llm:
        runner = llm.engine.worker.worker.runner
        layers = runner.model.model.layers
        assert [isinstance(layer, MissingModule) for layer in layers] == [True, False]
        assert isinstance(runner.model.model.embed_tokens, MissingModule)
        assert not isinstance(runner.model.lm_head, MissingModule)
        assert len(runner.kv_cache) == 1
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert not live_children()


def test_stage_layer_ranges_cover_the_layers_in_order():
    for layers, stages in [(2, 2), (5, 2), (7, 3), (32, 4)]:
        ranges = [PipelineStage(i, stages).layer_range(layers) for i in range(stages)]
        assert [i for r in ranges for i in r] == list(range(layers))
        sizes = [len(r) for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_global_rank_zero_is_the_last_stages_first_rank():
    stages = [PipelineStage.of_rank(rank, tp_size=2, count=3) for rank in range(6)]
    assert [(s.index, s.tp_rank) for s in stages] == [
        (2, 0),
        (2, 1),
        (1, 0),
        (1, 1),
        (0, 0),
        (0, 1),
    ]
    first = stages[4]  # stage 0, tensor-parallel rank 0: sends to stage 1's rank 0
    assert first.global_rank(1) == 2 and first.global_rank(0) == 4


@pytest.mark.timeout(60)
def test_what_cannot_be_staged_is_refused_by_name(tmp_path):
    save_hf_model("gemma2", tmp_path / "gemma2")  # local and global layers: two groups
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=2: Gemma2ForCausalLM .* KV cache groups"
    ):
        LLM(str(tmp_path / "gemma2"), pipeline_parallel_size=2, skip_tokenizer_init=True)
    save_hf_model("llama", tmp_path / "llama")  # two layers
    with pytest.raises(ValueError, match=r"it has 2 layers, fewer than the stages"):
        LLM(str(tmp_path / "llama"), pipeline_parallel_size=3, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an integer in \[1, 64\]"):
        LLM(str(tmp_path / "llama"), pipeline_parallel_size=0, skip_tokenizer_init=True)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config: not supported with pipeline"):
        LLM(
            str(tmp_path / "llama"),
            pipeline_parallel_size=2,
            speculative_config=spec,
            skip_tokenizer_init=True,
        )
    assert not live_children()  # refused before any rank started


@pytest.mark.timeout(120)
def test_a_stage_loads_only_its_own_weights(tmp_path):
    """The last stage of a tied-embedding model (GPT-2) fills its head from the
    embedding's checkpoint tensor, which its own stage does not hold."""
    save_hf_model("gpt2", tmp_path)
    with LLM(str(tmp_path), pipeline_parallel_size=2, skip_tokenizer_init=True) as llm:
        model = llm.engine.worker.worker.runner.model
        names = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" in names and not any(n.startswith("transformer.wte") for n in names)
    assert not any(n.startswith("transformer.h.0.") for n in names)
    assert any(n.startswith("transformer.h.1.") for n in names)


def test_rows_split_into_contiguous_parts_of_about_equal_tokens():
    rows = list("abcdef")
    assert split_rows(rows, [1, 1, 1, 1, 1, 1], 2) == [list("abc"), list("def")]
    assert split_rows(rows, [1, 1, 1, 1, 1, 1], 3) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert split_rows(rows, [1, 1, 1, 1, 1, 30], 2) == [list("abcde"), ["f"]]
    assert split_rows(rows, [30, 1, 1, 1, 1, 1], 2) == [["a"], list("bcdef")]
    assert split_rows(["a"], [5], 3) == [["a"]]
    assert split_rows([], [], 2) == []
    for parts in (1, 2, 3, 7):
        runs = split_rows(rows, [3, 1, 4, 1, 5, 9], parts)
        assert [r for run in runs for r in run] == rows and len(runs) <= parts


@pytest.mark.timeout(240)
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_any_number_of_micro_batches_gives_the_same_tokens(micro_batches, tmp_path):
    save_hf_model("qwen2", tmp_path)
    _assert_same_as_one_device(str(tmp_path), pipeline_micro_batches=micro_batches)


@pytest.mark.timeout(120)
def test_dummy_weights_in_two_stages_are_one_devices(tmp_path):
    """Each matrix draws from a seed of its own name, so stages get one device's values."""
    save_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    tokens = {}
    for pp in (1, 2):
        with LLM(
            str(tmp_path), load_format="dummy", pipeline_parallel_size=pp, skip_tokenizer_init=True
        ) as llm:
            out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=8, temperature=0))
        tokens[pp] = list(out[0].outputs[0].token_ids)
    assert tokens[2] == tokens[1]
    assert not live_children()
