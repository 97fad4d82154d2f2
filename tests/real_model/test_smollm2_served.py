"""The default model served: `pagedserve serve` with no model answers the openai client,
keeps a multi-turn WebSocket chat's context (turn 2 reuses turn 1's KV blocks), and the
chat page in headless Chromium shows a coherent reply."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tests.web.conftest import RunningServer
from tests.web.test_chat_page import ASSISTANT, BROWSER, LAST_REPLY, STREAMING, Browser, Page
from web.client import AsyncClient

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]
HITS = "pagedserve_prefix_cache_hit_tokens_total"


def test_openai_chat_completion_knows_the_capital_of_france(smollm2_server: RunningServer):
    from openai import OpenAI

    api = OpenAI(base_url=smollm2_server.http + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["SmolLM2-135M-Instruct"]
    reply = api.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=64,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.asyncio(loop_scope="function")
async def test_a_websocket_chat_keeps_its_context_from_the_prefix_cache(smollm2_server):
    async with asyncio.timeout(240), AsyncClient(smollm2_server.ws) as client:
        chat = client.chat_session(system="You are a helpful assistant.")
        first = chat.send("My name is Ada. Please remember it.", max_tokens=48, temperature=0)
        [d async for d in first]
        before = smollm2_server.metric(HITS)
        second = chat.send("What is my name?", max_tokens=32, temperature=0)
        text = "".join([d.text async for d in second])
        hits = smollm2_server.metric(HITS) - before
        # turn 2's prompt starts with turn 1's prompt and reply: all but the last partial
        # block comes from the cache
        assert hits >= first.result.usage.prompt_tokens - 16, (hits, first.result.usage)
        assert second.result.usage.prompt_tokens > first.result.usage.prompt_tokens
        assert "Ada" in text
        await chat.close()


@pytest.mark.skipif(BROWSER is None, reason="needs Debian chromium (apt-get install chromium)")
@pytest.mark.asyncio(loop_scope="function")
async def test_the_chat_page_shows_a_coherent_reply(smollm2_server, tmp_path) -> None:
    browser = Browser(BROWSER, tmp_path / "profile")
    try:
        async with connect(browser.devtools_url(), max_size=None, proxy=None) as ws:
            page = await Page.open(ws)
            await page.call("Page.navigate", url=smollm2_server.http + "/")
            await page.wait_for("document.readyState === 'complete'")
            assert await page.eval("document.getElementById('builtin-note').hidden")
            await page.fill("#temperature", "0")
            await page.fill("#prompt", "What is the capital of France?")
            await page.click("#send")
            await page.wait_for(f"{ASSISTANT}.length === 1 && !({STREAMING})", timeout=60)
            reply = await page.eval(f"{LAST_REPLY}.textContent")
            assert "Paris" in reply
            shot = await page.call("Page.captureScreenshot", format="png")
            png = base64.b64decode(shot["data"])
            assert png.startswith(b"\x89PNG") and len(png) > 10_000
            keep = os.environ.get("PAGEDSERVE_SCREENSHOT")  # e.g. docs/images/chat_page.png
            Path(keep or tmp_path / "chat_page.png").write_bytes(png)
    finally:
        browser.kill()
