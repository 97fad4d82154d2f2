"""The linear layers' GEMM choice (`linear_kernel`): oneDNN-packed weights give the plain
path's greedy tokens, each weight is held once, and a choice that cannot run says why."""

from __future__ import annotations

import random

import pytest
import torch

from cuda_ext.packed_gemm import packed_gemm_support
from engine import LLM, SamplingParams
from engine.config import DeviceConfig
from engine.worker.models.prepack import prepack_linears
from engine.worker.parallel.layers import PACKABLE_LAYERS
from tests.engine.tiny_models import VOCAB, save_hf_model

WHY_NOT = packed_gemm_support(torch.float32)
needs_onednn = pytest.mark.skipif(WHY_NOT is not None, reason=f"no oneDNN: {WHY_NOT}")


def _llm(directory, kernel: str, **kwargs) -> LLM:
    return LLM(str(directory), skip_tokenizer_init=True, seed=0, linear_kernel=kernel, **kwargs)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: [in, out] Conv1D weights, tied
def test_packed_gives_the_plain_paths_tokens(tmp_path, arch):
    save_hf_model(arch, tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 4, 9, 25)]
    packed, plain = _llm(tmp_path, "onednn"), _llm(tmp_path, "torch")
    assert packed.engine.worker.runner.linear_kernel.name == "onednn"
    assert plain.engine.worker.runner.linear_kernel.name == "torch"
    assert _greedy(packed, prompts) == _greedy(plain, prompts)
    packed.engine.check_integrity()


@needs_onednn
def test_each_weight_is_held_once(tmp_path):
    save_hf_model("gpt2", tmp_path)  # ties its LM head to the token embedding
    runner = _llm(tmp_path, "auto").engine.worker.runner
    model = runner.model
    layers = [m for m in model.modules() if isinstance(m, PACKABLE_LAYERS)]
    assert runner.linear_kernel.num_packed == len(layers) > 0
    assert all(m.packed is not None for m in layers)
    untied = [m for m in layers if m is not model.lm_head]
    assert all(m.weight.numel() == 0 for m in untied)  # only the packed copy is left
    embedding = model.get_submodule("transformer.wte")
    assert model.lm_head.weight is embedding.weight and embedding.weight.numel() > 0


def test_torch_kernel_packs_nothing(tmp_path):
    save_hf_model("llama", tmp_path)
    runner = _llm(tmp_path, "torch").engine.worker.runner
    assert runner.linear_kernel.num_packed == 0
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, PACKABLE_LAYERS))


def test_onednn_that_cannot_run_says_why():
    class OffDevice(torch.nn.Module):  # stands for a model on a GPU
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2, 2))

    with pytest.raises(ValueError, match="linear_kernel='onednn' cannot run: .*CPUs"):
        prepack_linears(OffDevice(), "onednn", "cuda")
    choice = prepack_linears(OffDevice(), "auto", "cuda")
    assert choice.name == "torch" and "CPUs" in choice.reason


def test_a_compiled_model_keeps_torchs_linear():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="torch.compile"):
        prepack_linears(model, "onednn", "cpu", compiled=True)
    assert prepack_linears(model, "auto", "cpu", compiled=True).name == "torch"


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        DeviceConfig(linear_kernel="mkl")
