"""`compile_model=True`: the forward pass through torch.compile gives transformers'
greedy tokens, batched with prefill chunks, and attention stays the chosen backend."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.worker.compiled_model import OpaqueBackend
from engine.worker.models.layers import PagedAttention
from tests.engine.tiny_models import VOCAB, hf_greedy, save_hf_model

MAX_NEW = 8


@pytest.mark.timeout(600)
def test_compiled_model_matches_transformers(tmp_path):
    model = save_hf_model("llama", tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 30)]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    llm = LLM(
        str(tmp_path), skip_tokenizer_init=True, compile_model=True, max_num_batched_tokens=24
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    model_runner = llm.engine.worker.runner
    attentions = [m for m in model_runner.model.modules() if isinstance(m, PagedAttention)]
    assert attentions and all(isinstance(m.backend, OpaqueBackend) for m in attentions)
    assert llm.stats().attention_backend == model_runner.backend.name
    llm.engine.check_integrity()
