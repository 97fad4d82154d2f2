"""The official `openai` package against a running server; greedy text equals the
offline `LLM` on the same weights (the built-in model anywhere, stories260K with
../shared)."""

from __future__ import annotations

import httpx
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


async def test_info_names_the_attention_backend_why_and_the_memory(builtin_server) -> None:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{builtin_server.http}/v1/info", timeout=30) as reply:
        info = json.load(reply)
    assert info["attention_backend"] in ("native", "sdpa")
    assert info["attention_backend_reason"]
    memory = info["memory"]  # what the weights and the KV cache take, as the log says
    assert memory["weights_bytes"] > 0 and memory["kv_cache_bytes"] > 0
    assert memory["quantization"] == "none" and memory["kv_cache_dtype"] in ("float32", "bfloat16")
    assert memory["max_concurrency"] > 0


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


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http}{path}", json=body, timeout=60)


async def test_logprob_tokens_join_into_the_text(served) -> None:
    """Each logprob token is the text it adds (SentencePiece's ' there', not 'there'),
    so plain text's tokens join into it; text_offset is where each starts."""
    api = client(served)
    kwargs = dict(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0)
    out = (await api.completions.create(logprobs=2, **kwargs)).choices[0]
    assert out.finish_reason == "length"
    lp = out.logprobs
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(out.text[at:].startswith(t) for at, t in zip(lp.text_offset, lp.tokens, strict=True))
    streamed = await api.completions.create(logprobs=2, stream=True, **kwargs)
    tokens, offsets = [], []
    async for chunk in streamed:
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
            offsets += c.logprobs.text_offset if c.logprobs else []
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)
    chat = await api.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(bytes(t.bytes) == t.token.encode() for t in content)


async def test_echo_puts_the_prompt_first(served) -> None:
    api = client(served)
    kwargs = dict(model=served.model, prompt=PROMPT, max_tokens=6, temperature=0)
    plain = await api.completions.create(logprobs=1, **kwargs)
    echoed = await api.completions.create(echo=True, logprobs=1, **kwargs)
    text, lp = echoed.choices[0].text, echoed.choices[0].logprobs
    assert text == PROMPT + plain.choices[0].text
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as OpenAI
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:num_prompt]).endswith(PROMPT)  # after BOS's text, if any
    assert lp.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    streamed = await api.completions.create(echo=True, logprobs=1, stream=True, **kwargs)
    parts, tokens = [], []
    async for chunk in streamed:
        for c in chunk.choices:
            parts.append(c.text)
            tokens += c.logprobs.tokens if c.logprobs else []
    assert ("".join(parts), tokens) == (text, lp.tokens)
    no_logprobs = await api.completions.create(echo=True, **kwargs)
    assert no_logprobs.choices[0].text == text


async def test_echo_with_n_best_of_and_token_prompts(served) -> None:
    """Every choice gets its prompt's entries, whichever sequence scored the prompt
    (best_of > n used to lose them); a token-id prompt echoes its decoded text."""
    api = client(served)
    kwargs = dict(model=served.model, max_tokens=4, temperature=1.0, seed=2, echo=True)
    kwargs["extra_body"] = {"ignore_eos": True}
    for extra in ({"n": 2}, {"n": 2, "best_of": 3}):
        out = await api.completions.create(prompt=PROMPT, logprobs=0, **extra, **kwargs)
        for choice in out.choices:
            assert choice.text.startswith(PROMPT)
            assert len(choice.logprobs.tokens) == out.usage.prompt_tokens + 4
            assert choice.logprobs.token_logprobs[0] is None
            assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    ids = _post(served, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    by_ids = await api.completions.create(prompt=ids["tokens"], **kwargs)
    assert by_ids.choices[0].text.startswith(PROMPT)


async def test_max_tokens_past_the_context_is_a_400_with_both_numbers(builtin_server) -> None:
    api = client(builtin_server)
    tokenized = _post(builtin_server, "/tokenize", {"prompt": PROMPT}).json()
    context, num_prompt = tokenized["max_model_len"], tokenized["count"]
    room = context - num_prompt
    with pytest.raises(BadRequestError) as refused:
        await api.completions.create(model=builtin_server.model, prompt=PROMPT, max_tokens=room + 1)
    error = refused.value.body
    assert error["param"] == "max_tokens"
    assert f"maximum context length is {context} tokens" in error["message"]
    assert f"({num_prompt} in the prompt, {room + 1} in the completion)" in error["message"]
    fits = await api.completions.create(
        model=builtin_server.model, prompt=PROMPT, max_tokens=room, temperature=0, stop=["e"]
    )
    assert fits.choices[0].finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequestError) as refused:
        await api.chat.completions.create(
            model=builtin_server.model, messages=messages, max_completion_tokens=context
        )
    assert refused.value.body["param"] == "max_completion_tokens"
    assert "in the messages" in refused.value.body["message"]


async def test_unset_max_tokens_is_cut_to_the_context(builtin_server) -> None:
    """No max_tokens: the server's default, cut to what the context leaves (vLLM)."""
    probe = _post(builtin_server, "/tokenize", {"prompt": "a"}).json()
    prompt = "a" * (probe["max_model_len"] - 24)
    num_prompt = _post(builtin_server, "/tokenize", {"prompt": prompt}).json()["count"]
    reply = _post(builtin_server, "/v1/completions", {"prompt": prompt, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == probe["max_model_len"] - num_prompt


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_media_content_parts_are_refused(builtin_server, kind: str) -> None:
    part = {"type": kind, kind: {"url": "data:,x"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    reply = _post(builtin_server, "/v1/chat/completions", body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[1].type"
    assert error["message"] == (
        f"messages[0].content[1].type {kind!r} is not supported: this server serves a "
        "text-only model"
    )


async def test_text_parts_still_work(builtin_server) -> None:
    api = client(builtin_server)
    kwargs = dict(model=builtin_server.model, max_tokens=8, temperature=0)
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]
    by_parts = await api.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **kwargs
    )
    whole = await api.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me a story."}], **kwargs
    )
    assert by_parts.choices[0].message.content == whole.choices[0].message.content
    named = {"role": "user", "content": "hi", "name": "bob"}
    reply = _post(builtin_server, "/v1/chat/completions", {"messages": [named]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].name"


@pytest.mark.parametrize(
    "options",
    [
        {"stream_options": {"include_usage": True}},
        {"stream": False, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        {"stream": True, "stream_options": {"include_usage": "yes"}},
    ],
)
def test_stream_options_are_refused_unless_streaming_usage(builtin_server, options) -> None:
    reply = _post(builtin_server, "/v1/completions", {"prompt": PROMPT, **options})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "stream_options"


def test_user_identifies_the_caller(builtin_server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert _post(builtin_server, "/v1/completions", {**body, "user": "alice"}).status_code == 200
    reply = _post(builtin_server, "/v1/completions", {**body, "user": 5})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "user"


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/v1/nope", 404, "NotFoundError"),
        ("POST", "/v1/chat", 404, "NotFoundError"),
        ("GET", "/v1/completions", 405, "invalid_request_error"),
        ("PUT", "/v1/chat/completions", 405, "invalid_request_error"),
    ],
)
def test_unknown_paths_and_methods_answer_openai_errors(builtin_server, method, path, status, kind):
    reply = httpx.request(method, f"{builtin_server.http}{path}", timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (kind, status, None)
    assert path in error["message"]
