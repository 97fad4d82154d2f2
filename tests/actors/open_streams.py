"""Streaming requests in tests: to their end, or left streaming while a test breaks
something under them."""

from __future__ import annotations

import asyncio

from engine.messages import OutputDelta
from engine.sampling_params import SamplingParams


async def streams_under_way(
    engine, request_ids: list[str], max_tokens: int = 60
) -> list[asyncio.Task[OutputDelta | None]]:
    """Starts one long request per id on `engine` (prompt [3, 4, 5], EOS ignored) and
    returns once the first token of any has arrived; each task ends with its stream's
    last output."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first_token = asyncio.Event()

    async def consume(request_id: str) -> OutputDelta | None:
        last = None
        async for out in engine.generate([3, 4, 5], params, request_id):
            first_token.set()
            last = out
        return last

    tasks = [asyncio.create_task(consume(rid)) for rid in request_ids]
    await asyncio.wait_for(first_token.wait(), timeout=60)
    return tasks


async def tokens_of(engine, prompt, params: SamplingParams, request_id: str) -> list[list[int]]:
    """Every sequence's token ids (by output index) of one request streamed to its end;
    fails the test on an error."""
    per_seq: dict[int, list[int]] = {}
    async for out in engine.generate(prompt, params, request_id):
        assert out.error is None, out.error
        per_seq.setdefault(out.index, []).extend(out.token_ids)
    return [per_seq[i] for i in sorted(per_seq)]
