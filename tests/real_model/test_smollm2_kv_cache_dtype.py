"""The default model with its KV cache in 8 bits: chat answers are the float cache's,
token for token up to the first near-tie (the float run's two best candidates within
0.1 nats: measured divergences came at 0.023 for int8, 0.011-0.069 for fp8), and over
a 1,024-token text (a paragraph repeated: copying it back needs exact attention; read
in chunks of 256) every token's log-probability stays within a stated bound of the
float cache's, the mean shift too, without growing along the context (measured: mean /
worst 0.004 / 0.17 for int8, 0.012 / 1.54 for fp8).

On ShareGPT turns (python bench/kv_cache_dtype.py): 0.026 / 0.26 (int8), 0.066 / 0.70
(fp8), 0.135 / 2.9 (fp8_e5m2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.quantized_checks import first_near_tie, token_logprobs
from tests.real_model.test_smollm2_offline import CHATS

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
    "France. It is named after the engineer Gustave Eiffel, whose company designed and "
    "built the tower from 1887 to 1889 as the centrepiece of the World's Fair. Locally "
    "nicknamed 'La dame de fer', it was criticised by some of France's leading artists "
    "and intellectuals for its design, but it has become a global cultural icon of "
    "France and one of the most recognisable structures in the world. "
)
BOUNDS = {"int8": (0.02, 0.5), "fp8": (0.05, 2.5)}  # (mean, worst) shift
TIE = 0.1


def engine(path: Path, kv_cache_dtype: str) -> LLM:
    return LLM(
        str(path),
        seed=0,
        kv_cache_memory=128 << 20,
        max_model_len=1100,
        max_num_batched_tokens=256,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.fixture(scope="module")
def floats(smollm2_path: Path) -> LLM:
    return engine(smollm2_path, "auto")


@pytest.mark.parametrize("code", ["int8", "fp8"])
def test_chat_answers_and_a_long_text_follow_the_float_cache(smollm2_path, floats, code):
    ours = engine(smollm2_path, code)
    prompts = [floats.get_tokenizer().apply_chat_template(chat) for chat in CHATS]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2, ignore_eos=True)
    mine, theirs = (llm.generate(prompts, params, use_tqdm=False) for llm in (ours, floats))
    for a, b in zip(mine, theirs, strict=True):
        clear = first_near_tie(b.outputs[0], TIE)
        assert a.outputs[0].token_ids[:clear] == b.outputs[0].token_ids[:clear]

    ids = floats.get_tokenizer().encode(PARAGRAPH * 12, add_special_tokens=False)[:1024]
    assert len(ids) == 1024
    shifts = [
        abs(a - b)
        for a, b in zip(*(token_logprobs(llm, [ids])[0] for llm in (ours, floats)), strict=True)
    ]
    mean_bound, worst_bound = BOUNDS[code]
    mean = sum(shifts) / len(shifts)
    assert mean < mean_bound and max(shifts) < worst_bound, (mean, max(shifts))
    late = shifts[-256:]
    assert sum(late) / len(late) < 2 * mean + 1e-3  # no growth along the context
