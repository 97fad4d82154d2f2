"""The default model computed in its Q4_1 blocks (`quantization='gguf'`, the default for
a GGUF on a CPU) against the same blocks dequantized at load ('none'): activations rounded
to int8 twice (the rounding error rounded again) for few rows, float panels for many,
keep the chat answers token for token,
every token's log-probability within 0.05 (measured: 0.001), and the weights in a sixth
of the bytes. Rounded once, as llama.cpp does, this file answers "What is the capital of
France?" with "L'Étoile, la Marseillaise, ..." (in llama-server too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.quantized_checks import assert_follows, mean_loglik
from tests.real_model.test_smollm2_offline import CHATS

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
    "France. It is named after the engineer Gustave Eiffel, whose company designed and "
    "built the tower from 1887 to 1889 as the centrepiece of the World's Fair."
)


def engine(path: Path, quantization: str | None) -> LLM:
    return LLM(
        str(path), seed=0, kv_cache_memory=64 << 20, max_model_len=1024, quantization=quantization
    )


def test_q4_1_blocks_follow_the_dequantized_model(smollm2_path: Path) -> None:
    blocks, floats = engine(smollm2_path, None), engine(smollm2_path, "none")
    assert blocks.config.model.quantization.value == "gguf"  # the default
    prompts = [floats.get_tokenizer().apply_chat_template(chat) for chat in CHATS]
    params = SamplingParams(temperature=0, max_tokens=32)
    ours = blocks.generate(prompts, params, use_tqdm=False)
    theirs = floats.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert_follows(blocks, floats, prompts, 32, bound=0.05, mean_bound=0.01)
    assert mean_loglik(blocks, TEXT) == pytest.approx(mean_loglik(floats, TEXT), rel=0.005)
    assert blocks.stats().weights_bytes * 6 < floats.stats().weights_bytes
