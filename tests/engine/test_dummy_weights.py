"""`load_format='dummy'`: a checkpoint's config alone gives a model at the real shapes
with random weights (N(0, 0.02) matrices, unit norms, zero biases), the same for the same
seed; it serves like any other (benchmarks of large shapes use it)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.tiny_models import save_hf_model

ENGINE = dict(skip_tokenizer_init=True, kv_cache_memory=16 << 20, max_model_len=64)


def parameters(llm: LLM) -> dict[str, torch.Tensor]:
    return dict(llm.engine.worker.runner.model.named_parameters())


@pytest.mark.timeout(120)
def test_dummy_weights_are_seeded_normal_matrices_unit_norms_and_zero_biases(tmp_path):
    save_hf_model("qwen2", tmp_path)  # qwen2 has biases on q/k/v
    (tmp_path / "model.safetensors").unlink()  # the config is all a dummy load reads
    with LLM(str(tmp_path), load_format="dummy", seed=3, **ENGINE) as llm:
        params = parameters(llm)
        tokens = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6))
    matrices = torch.cat([p.flatten() for p in params.values() if p.dim() >= 2])
    assert abs(matrices.float().std().item() - 0.02) < 0.001
    assert abs(matrices.float().mean().item()) < 0.001
    biases = [p for n, p in params.items() if n.endswith("bias")]
    assert biases and all(torch.count_nonzero(b) == 0 for b in biases)
    norms = [p for n, p in params.items() if p.dim() == 1 and not n.endswith("bias")]
    assert norms and all(torch.all(p == 1) for p in norms)
    assert len(tokens[0].outputs[0].token_ids) == 6
    with LLM(str(tmp_path), load_format="dummy", seed=3, **ENGINE) as again:
        assert all(torch.equal(p, parameters(again)[n]) for n, p in params.items())
