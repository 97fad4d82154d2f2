"""The real stories260K checkpoint reproduces llama2.c's own greedy outputs, batched."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from tests.conftest import shared_path


@pytest.fixture(scope="module")
def reference():
    return json.loads(shared_path("models", "reference", "stories260K_greedy.json").read_text())


@pytest.fixture(scope="module")
def llm():
    return LLM(str(shared_path("models", "stories260K")), kv_cache_memory=32 << 20)


@pytest.mark.shared
@pytest.mark.parametrize("block_size_budget", [None, 64])
def test_reproduces_llama2c_greedy_outputs_batched(reference, block_size_budget):
    kwargs = {"kv_cache_memory": 32 << 20}
    if block_size_budget:
        kwargs["max_num_batched_tokens"] = block_size_budget  # chunked prompts as well
    llm = LLM(str(shared_path("models", "stories260K")), **kwargs)
    cases = reference["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    # run.c counts positions after BOS: prompt - 1 + generated <= max_total_tokens.
    params = [
        SamplingParams(
            temperature=0, max_tokens=c["max_total_tokens"] - len(c["prompt_token_ids"]) + 1
        )
        for c in cases
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for case, out in zip(cases, outputs, strict=True):
        assert out.outputs[0].token_ids == case["greedy_token_ids"], case["prompt"]
    # run.c stops when it samples BOS (1): generation_config.json lists it as an EOS id.
    stopped = [o.outputs[0].finish_reason for o in outputs]
    assert stopped == ["stop" if c["greedy_token_ids"][-1] == 1 else "length" for c in cases]


@pytest.mark.shared
def test_text_prompts_tokenize_like_the_reference(reference, llm):
    case = next(c for c in reference["cases"] if c["prompt"])
    out = llm.generate(case["prompt"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].prompt_token_ids == case["prompt_token_ids"]
    assert out[0].outputs[0].token_ids == case["greedy_token_ids"][:8]
    assert out[0].outputs[0].text  # detokenized


@pytest.mark.shared
def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Tell me a story"}]
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert out.prompt_token_ids == tok.apply_chat_template(messages, True)
    assert len(out.outputs[0].token_ids) == 10
    two = llm.chat(
        [messages, messages], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids[:4]] * 2


@pytest.mark.shared
def test_stop_strings_truncate_the_text(llm):
    prompt = "Once upon a time"
    [full] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    text = full.outputs[0].text
    assert "Lily" in text
    [cut] = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]), use_tqdm=False
    )
    assert cut.outputs[0].text == text[: text.index("Lily")]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == "Lily"
    [kept] = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=40, stop=["Lily"], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: text.index("Lily") + 4]


@pytest.mark.shared
def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    [out] = llm.generate("Once upon a time", params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert entry[token].decoded_token is not None
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
    )
    pl = out.prompt_logprobs
    assert len(pl) == len(out.prompt_token_ids) and pl[0] is None
    for token, entry in zip(out.prompt_token_ids[1:], pl[1:], strict=True):
        assert token in entry and entry[token].logprob <= 0
        assert 2 <= len(entry) <= 3
