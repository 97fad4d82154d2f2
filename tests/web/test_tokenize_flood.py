"""/tokenize cannot be used as an amplifier: input that cannot fit the context is
refused before any tokenizing, and tokenize calls run apart from generation's
admission, so 16 clients flooding it leave a 1-token completion fast."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

FLOODERS = 16
HUGE = "word " * 200_000  # 1 MB of text: far past any context
TOKENS = list(range(100)) * 1000  # 100,000 ids: past the built-in model's context


def test_text_past_the_context_is_refused_by_name(builtin_server) -> None:
    start = time.monotonic()
    prompt = httpx.post(f"{builtin_server.http}/tokenize", json={"prompt": HUGE[:900_000]})
    chat = {"messages": [{"role": "user", "content": HUGE[:900_000]}]}
    messages = httpx.post(f"{builtin_server.http}/tokenize", json=chat)
    ids = httpx.post(f"{builtin_server.http}/detokenize", json={"tokens": TOKENS})
    assert time.monotonic() - start < 2.0
    for answer, field in ((prompt, "prompt"), (messages, "messages"), (ids, "tokens")):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == field and "max_model_len" in error["message"], error


async def test_a_tokenize_flood_leaves_completions_fast(builtin_server) -> None:
    stop = asyncio.Event()
    refused = 0

    async def flood(client: httpx.AsyncClient) -> None:
        nonlocal refused
        while not stop.is_set():
            answer = await client.post("/tokenize", json={"prompt": HUGE[:900_000]})
            assert answer.status_code in (400, 503), answer.text
            refused += 1

    async with httpx.AsyncClient(base_url=builtin_server.http, timeout=60) as client:
        flooders = [asyncio.create_task(flood(client)) for _ in range(FLOODERS)]
        try:
            await asyncio.sleep(0.5)  # the flood is under way
            latencies = []
            for _ in range(5):
                start = time.monotonic()
                done = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                latencies.append(time.monotonic() - start)
                assert done.status_code == 200, done.text
        finally:
            stop.set()
            await asyncio.gather(*flooders)
    assert statistics.median(latencies) < 1.0, latencies
    assert refused >= FLOODERS
