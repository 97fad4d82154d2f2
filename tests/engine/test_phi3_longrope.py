"""Phi-3's longrope picks its short or long factors by a sequence's current length, as
transformers does (`rotary_table_rows`): greedy tokens equal transformers' `generate` for
sequences that stay within original_max_position_embeddings and for prompts longer than
it, each computed in one step. (A sequence that crosses it while decoding is not exact:
`generate` then recomputes its whole cache with the long factors; see phi3.py.)"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny_models import ARCHITECTURES, VOCAB, hf_greedy, save_hf_model

ORIGINAL = 16  # original_max_position_embeddings
PROMPT_LENS = (1, 4, 5, 17, 20, 33)  # 5 + 12 new tokens end at 16; 17 starts past it
MAX_NEW = 12


def _variant(original: int) -> tuple:
    config_cls, model_cls, fields = ARCHITECTURES["phi3"]
    return config_cls, model_cls, {**fields, "original_max_position_embeddings": original}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, prompts, HF greedy outputs, HF outputs had every step used the short
    factors) for the tiny Phi-3 with ORIGINAL."""
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    outputs = {}
    with pytest.MonkeyPatch.context() as mp:
        for original in (ORIGINAL, 128):  # 128: no sequence here passes it
            mp.setitem(ARCHITECTURES, "phi3-longrope", _variant(original))
            directory = tmp_path_factory.mktemp(f"phi3-longrope-{original}")
            model = save_hf_model("phi3-longrope", directory)
            outputs[original] = directory, [hf_greedy(model, p, MAX_NEW) for p in prompts]
    directory, expected = outputs[ORIGINAL]
    return directory, prompts, expected, outputs[128][1]


def test_the_long_factors_change_the_tokens(checkpoint):
    _, _, expected, short_only = checkpoint
    assert expected != short_only


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_transformers_across_the_original_length(checkpoint, block_size):
    directory, prompts, expected, _ = checkpoint
    llm = LLM(str(directory), skip_tokenizer_init=True, seed=0, block_size=block_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.engine.check_integrity()
