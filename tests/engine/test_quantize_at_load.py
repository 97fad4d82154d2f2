"""`quantization='int8'` and `'q4_0'`: a float (safetensors) checkpoint's linear weights
are quantized into 8- or 4-bit blocks of 32 while loading (each rank its own slice) and
multiplied in them; embeddings, norms and the LM head stay floats. Tokens and
log-probabilities follow the float path's within stated bounds, the weights take fewer
bytes (test_gguf_quantized.py checks that a GGUF is not quantized again)."""

from __future__ import annotations

import random

import pytest

from engine import LLM
from engine.worker.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.worker.quantized_weight import QuantizedWeight
from tests.engine.quantized_checks import assert_follows
from tests.engine.tiny_models import VOCAB, save_hf_model

ENGINE = dict(skip_tokenizer_init=True, seed=0, kv_cache_memory=16 << 20, max_model_len=96)
rng = random.Random(7)
PROMPTS = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41, 60)]
# Token log-probabilities against the float path's (tests/engine/quantized_checks.py),
# (largest, mean) shift: the weights' rounding to 8 or 4 bits (the activations' is far
# smaller). Measured on these models: int8 0.058 / 0.012, q4_0 1.04 / 0.19 (4-bit
# weights move the flat distributions of a random tiny model a lot; the mean
# log-likelihood stays within 0.6%).
BOUNDS = {"int8": (0.1, 0.02), "q4_0": (1.5, 0.3)}


def linear_layers(llm: LLM) -> list:
    model = llm.engine.worker.runner.model
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["int8", "q4_0"])
def test_linear_weights_quantized_at_load_keep_the_float_paths_tokens(tmp_path, arch, method):
    save_hf_model(arch, tmp_path)
    floats = LLM(str(tmp_path), quantization="none", **ENGINE)
    blocks = LLM(str(tmp_path), quantization=method, **ENGINE)
    layers = linear_layers(blocks)
    assert layers and all(isinstance(m.packed, QuantizedWeight) for m in layers)
    assert {t for m in layers for t in m.packed.types} == {"Q8_0" if method == "int8" else "Q4_0"}
    assert_follows(blocks, floats, PROMPTS, 16, *BOUNDS[method])
    ours, theirs = blocks.stats(), floats.stats()
    assert ours.quantization == method and ours.weights_bytes < theirs.weights_bytes
    blocks.engine.check_integrity()
