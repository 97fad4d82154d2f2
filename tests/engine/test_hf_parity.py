"""Greedy token ids from our engine equal transformers' `generate` on the same weights,
for every architecture, batched, under several block sizes, tiny prefill chunks, each
attention backend, either input preparation and forced preemption."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.worker.kv_cache import block_bytes
from tests.engine.tiny_models import ARCHITECTURES, VOCAB, hf_greedy, save_hf_model

MAX_NEW = 12
PROMPT_LENS = (1, 3, 7, 12, 20, 33)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    """(directory, prompts, HF greedy outputs) for one architecture."""
    directory = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, directory)
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return directory, prompts, expected


SETTINGS = {
    "block1": dict(block_size=1),
    "block16": dict(block_size=16),
    "block32": dict(block_size=32),
    "chunked": dict(block_size=4, max_num_batched_tokens=5),
    "reference-backend": dict(block_size=16, attention_backend="reference"),
    # the Triton kernels: interpreted here (tests/conftest.py), compiled on a GPU
    "triton-backend": dict(block_size=16, attention_backend="triton"),
    # the step's input built by the device-side path (Triton kernels, interpreted here)
    "device-inputs": dict(block_size=4, max_num_batched_tokens=9, input_preparation="device"),
    "torch-linear": dict(block_size=16, linear_kernel="torch"),  # the default packs for oneDNN
}


def _generate(directory, prompts, **kwargs):
    kwargs.setdefault("kv_cache_memory", 1 << 25)  # on a GPU the default is 0.9 of the card
    llm = LLM(str(directory), skip_tokenizer_init=True, seed=0, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_transformers(checkpoint, setting):
    directory, prompts, expected = checkpoint
    llm, got = _generate(directory, prompts, **SETTINGS[setting])
    assert got == expected
    llm.engine.check_integrity()
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_greedy_matches_transformers_under_preemption(checkpoint):
    directory, prompts, expected = checkpoint
    max_len, block_size = 64, 4
    probe = LLM(
        str(directory),
        skip_tokenizer_init=True,
        max_model_len=max_len,
        block_size=block_size,
        kv_cache_memory=1 << 20,
    )
    block_size = probe.config.cache.block_size  # raised where a state needs bigger pages
    per_block = block_bytes(probe.config.model, block_size)
    chunk = 16  # sliding-window layers hold a chunk and their window of a sequence
    one = probe.config.model.kv_cache_layout.max_blocks_per_sequence(max_len, chunk, block_size)
    budget = per_block * (one + 3)  # one full sequence, a little more, the null block
    llm, got = _generate(
        directory,
        prompts,
        block_size=block_size,
        max_model_len=max_len,
        kv_cache_memory=budget,
        max_num_batched_tokens=chunk,
    )
    assert llm.stats().num_preemptions > 0
    assert got == expected
