"""The official `openai` package against a running server; greedy text equals the
offline `LLM` on the same weights (the built-in model anywhere, stories260K with
../shared)."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, BadRequestError

from engine import LLM, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(params=["builtin", "stories"])
def served(request):
    return request.getfixturevalue(f"{request.param}_server")


def offline_text(server, prompt: str | None = None, messages=None, max_tokens: int = 16) -> str:
    from engine.worker.builtin_model import builtin_model_dir

    model = server.model_dir or str(builtin_model_dir())
    llm = LLM(model=model, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if messages is not None:
        return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def client(server) -> AsyncOpenAI:
    key = server.api_key or "none"
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key=key, timeout=60)  # not 600 s


async def test_completion_greedy_equals_offline(served) -> None:
    api = client(served)
    out = await api.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=16, temperature=0
    )
    assert out.choices[0].text == offline_text(served, PROMPT)
    assert out.choices[0].finish_reason in ("stop", "length")
    streamed = await api.completions.create(
        model=served.model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in streamed:
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert text == out.choices[0].text
    assert usage.completion_tokens == out.usage.completion_tokens


async def test_usage_counts_each_prompt_once_whatever_n(builtin_server) -> None:
    api = client(builtin_server)
    kwargs = dict(
        model=builtin_server.model,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    one = await api.completions.create(prompt=PROMPT, n=1, **kwargs)
    three = await api.completions.create(prompt=PROMPT, n=3, **kwargs)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens > 0
    assert three.usage.completion_tokens == 3 * 4
    two_prompts = await api.completions.create(prompt=[PROMPT, PROMPT + " there"], n=2, **kwargs)
    longer = await api.completions.create(prompt=PROMPT + " there", n=1, **kwargs)
    prompts = one.usage.prompt_tokens + longer.usage.prompt_tokens
    assert two_prompts.usage.prompt_tokens == prompts
    streamed = await api.completions.create(
        prompt=PROMPT, n=3, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    usage = [chunk.usage async for chunk in streamed if chunk.usage]
    assert [u.prompt_tokens for u in usage] == [one.usage.prompt_tokens]
    assert usage[0].total_tokens == one.usage.prompt_tokens + 12


async def test_chat_greedy_equals_offline(served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = await api.chat.completions.create(
        model=served.model, messages=messages, max_tokens=16, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline_text(served, messages=messages)
    stream = await api.chat.completions.create(
        model=served.model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == out.choices[0].message.content


async def test_n2_seed_logprobs_stop(served) -> None:
    api = client(served)
    kwargs = dict(model=served.model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3)
    a = await api.completions.create(n=2, logprobs=2, **kwargs)
    b = await api.completions.create(n=2, logprobs=2, **kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert [c.index for c in a.choices] == [0, 1]
    # one sequence group on the server: choice i is what seed 3 + i samples alone offline
    from engine.worker.builtin_model import builtin_model_dir

    llm = LLM(model=served.model_dir or str(builtin_model_dir()), kv_cache_memory=16 << 20)
    for i, choice in enumerate(a.choices):
        alone = SamplingParams(temperature=1.0, seed=3 + i, max_tokens=12)
        assert choice.text == llm.generate([PROMPT], alone, use_tqdm=False)[0].outputs[0].text
    # best_of: the server's n best are the offline engine's
    best = await api.completions.create(n=2, best_of=4, **kwargs)
    ranked = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=12)
    offline = llm.generate([PROMPT], ranked, use_tqdm=False)[0].outputs
    assert [c.text for c in best.choices] == [c.text for c in offline]
    assert [c.index for c in best.choices] == [0, 1]
    for choice in a.choices:
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(lp.tokens) > 0
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = await api.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        n=2,
        seed=5,
    )
    assert len(chat.choices) == 2
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) <= 3 for t in content)
    # stop: the greedy text cut at a substring of itself
    full = (
        (
            await api.completions.create(
                model=served.model, prompt=PROMPT, max_tokens=16, temperature=0
            )
        )
        .choices[0]
        .text
    )
    stop = full[4:6]
    if stop.strip():
        cut = await api.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == full[: full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


async def test_models_and_errors(builtin_server) -> None:
    api = client(builtin_server)
    models = await api.models.list()
    assert [m.id for m in models.data] == [builtin_server.model]
    with pytest.raises(BadRequestError, match="top_p"):
        await api.completions.create(model=builtin_server.model, prompt="x", top_p=1.5)


async def test_info_names_the_attention_backend_and_why(builtin_server) -> None:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{builtin_server.http}/v1/info", timeout=30) as reply:
        info = json.load(reply)
    assert info["attention_backend"] in ("native", "sdpa")
    assert info["attention_backend_reason"]


async def test_beam_search_equals_offline(served) -> None:
    """vLLM's use_beam_search extra: the n best beams of width best_of (else n), the
    same as the offline engine's, plain and streamed (each choice arrives whole)."""
    from engine.worker.builtin_model import builtin_model_dir

    api = client(served)
    llm = LLM(model=served.model_dir or str(builtin_model_dir()), kv_cache_memory=16 << 20)
    beams = {"use_beam_search": True, "length_penalty": 0.8}
    kwargs = dict(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0)
    want = llm.generate(
        [PROMPT],
        SamplingParams(
            use_beam_search=True, length_penalty=0.8, n=2, best_of=3, temperature=0, max_tokens=10
        ),
        use_tqdm=False,
    )[0].outputs
    out = await api.completions.create(n=2, best_of=3, extra_body=beams, **kwargs)
    assert [c.text for c in out.choices] == [c.text for c in want]
    assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in want]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in want)
    stream = await api.completions.create(n=2, best_of=3, stream=True, extra_body=beams, **kwargs)
    texts = ["", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in want]
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = await api.chat.completions.create(
        model=served.model, messages=messages, n=2, max_tokens=8, temperature=0, extra_body=beams
    )
    offline_chat = llm.chat(
        messages,
        SamplingParams(use_beam_search=True, length_penalty=0.8, n=2, temperature=0, max_tokens=8),
        use_tqdm=False,
    )[0].outputs
    assert [c.message.content for c in chat.choices] == [c.text for c in offline_chat]


async def test_beam_search_refusals_name_the_field(builtin_server) -> None:
    api = client(builtin_server)
    kwargs = dict(model=builtin_server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    beams = {"use_beam_search": True}
    with pytest.raises(BadRequestError, match="logprobs must be None with use_beam_search"):
        await api.completions.create(n=2, logprobs=1, extra_body=beams, **kwargs)
    with pytest.raises(BadRequestError, match="top_p must be 1.0 with use_beam_search"):
        await api.completions.create(n=2, top_p=0.5, extra_body=beams, **kwargs)
    # the built-in model has one end token: each beam ranks 2 continuations, 20 at most
    with pytest.raises(BadRequestError, match=r"best_of \(the beam width; n when unset\)"):
        await api.completions.create(n=2, best_of=12, extra_body=beams, **kwargs)
    with pytest.raises(BadRequestError, match="early_stopping"):
        await api.completions.create(extra_body={**beams, "early_stopping": "soon"}, **kwargs)
    out = await api.completions.create(n=1, extra_body=beams, **kwargs)  # still serving
    assert out.choices[0].finish_reason in ("stop", "length")
