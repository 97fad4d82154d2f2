"""The default model computed in its Q4_1 blocks (`quantization='gguf'`) against the same
blocks dequantized at load (the default): held by tests/engine/quantized_checks.py's
rule over the chat prompts' continuations (measured: token log-probabilities move by
0.08 on average, 0.58 at most, the mean log-likelihood by 0.4%), with a fixed text's
mean log-likelihood within 0.5%, and the weights in a sixth of the bytes.

Greedy tokens are not the same: rounding activations to 8 bits, as llama.cpp does on this
file, turns "The capital of France is Paris." into "L'Étoile, la Marseillaise, ..."; so
does llama-server (docs/quantization.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.quantized_checks import assert_follows
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


def mean_loglik(llm: LLM) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [out] = llm.generate([TEXT], params, use_tqdm=False)
    rows, ids = out.prompt_logprobs[1:], out.prompt_token_ids[1:]
    return sum(row[i].logprob for row, i in zip(rows, ids, strict=True)) / len(ids)


def test_q4_1_blocks_follow_the_dequantized_model(smollm2_path: Path) -> None:
    blocks, floats = engine(smollm2_path, "gguf"), engine(smollm2_path, None)
    prompts = [floats.get_tokenizer().apply_chat_template(chat) for chat in CHATS]
    assert_follows(blocks, floats, prompts, 32, bound=0.8, mean_bound=0.12)
    assert mean_loglik(blocks) == pytest.approx(mean_loglik(floats), rel=0.005)
    assert blocks.stats().weights_bytes * 6 < floats.stats().weights_bytes
