"""OpenAI-compatible HTTP: /v1/completions and /v1/chat/completions, plain and SSE.

`n` choices of a prompt run as one engine request sampling n (or `best_of`) sequences on
the prompt's shared blocks (a seeded request gives sequence i the seed `seed + i`).
vLLM's `use_beam_search` (with `length_penalty`, `early_stopping`; width `best_of`, else
`n`) returns the n best beams, each choice whole when the search ends.

Every request gets an answer that says what happened: a result; a 4xx naming the field
at fault; a 5xx when the engine failed it (504 past the request timeout, 503 when the
server shut down before it finished: never a 200 that passes an abort off as a stop).
A plain request whose client hangs up is aborted at once (its blocks freed); a stream's
is aborted when its next chunk cannot be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.messages import OutputDelta
from engine.sampling_params import SamplingParams
from web.errors import ApiError, invalid
from web.frames import read_json_body
from web.generation import Generator, PromptInput, Timing, failure
from web.openai_format import ChoiceTally, logprobs_json, sse, usage
from web.params import (
    BEAM_FIELDS,
    SAMPLING_FIELDS,
    best_of,
    chat_messages,
    num_choices,
    only_keys,
    sampling_params,
)
from web.server_config import ServerConfig

logger = logging.getLogger(__name__)
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "logit_bias", "user"}
_COMMON |= {*SAMPLING_FIELDS, *BEAM_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
CLIENT_GONE = 499  # the status logged for a request whose client hung up (nginx's)


@dataclass(frozen=True)
class Job:
    """One parsed request: prompts x n choices with their params."""

    request_id: str
    prompts: list[PromptInput]
    params: SamplingParams  # n choices per prompt: one sequence group each
    stream: bool
    include_usage: bool
    top_logprobs: int | None


class OpenAIRoutes:
    """The two generation routes; errors come back in OpenAI's error shape."""

    def __init__(self, generator: Generator, config: ServerConfig) -> None:
        self.generator = generator
        self.config = config

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            body = await read_json_body(request, self.config.max_message_bytes)
            job = self._parse(body, chat)
            if job.stream:
                return await self._stream(job, chat)
            result = await _unless_disconnected(request, self._complete(job, chat))
            return JSONResponse(result) if result is not None else Response(status_code=CLIENT_GONE)
        except ApiError as err:
            headers = {"Retry-After": "1"} if err.status == 503 else {}
            headers |= {"Connection": "close"} if err.close else {}
            return JSONResponse(err.openai_body(), err.status, headers=headers)
        except Exception:  # a bug, never the client's input: logged, answered, served on
            logger.exception("%s failed", request.url.path)
            err = ApiError("engine_error", "internal error while handling the request")
            return JSONResponse(err.openai_body(), err.status)

    # -- parsing -------------------------------------------------------------------
    def _parse(self, body: dict[str, Any], chat: bool) -> Job:
        only_keys(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "the request")
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            raise ApiError(
                "not_found",
                f"model {str(model)[:100]!r} is not served here; this server "
                f"serves {self.config.model_name!r}",
                "model",
            )
        for name in ("echo", "suffix"):
            if body.get(name):
                raise invalid(f"{name} is not supported", name)
        n = num_choices(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise invalid(f"stream must be a bool, got {str(stream)[:40]!r}", "stream")
        ranked = best_of(body, n, stream)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        base = sampling_params(body, chat=chat, default_max_tokens=self.config.default_max_tokens)
        params = dataclasses.replace(base, n=n, best_of=ranked)
        prompts = [chat_messages(body.get("messages"))] if chat else _prompts(body.get("prompt"))
        top = body.get("top_logprobs") if chat else body.get("logprobs")
        if chat and not body.get("logprobs"):
            top = None
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Job(
            prefix + uuid.uuid4().hex,
            prompts,
            params,
            stream,
            bool(options.get("include_usage")),
            top,
        )

    # -- running -------------------------------------------------------------------
    async def _choices(self, job: Job) -> AsyncIterator[tuple[list[int], OutputDelta]]:
        """All choices' deltas as they come, each with the choice indices it is about
        (one, or every choice of its prompt for a request-wide end: abort, error)."""
        queue: asyncio.Queue[tuple[list[int], OutputDelta] | BaseException | None]
        queue = asyncio.Queue()
        n = job.params.n

        async def run(p: int, prompt: PromptInput) -> None:
            try:
                rid = f"{job.request_id}-{p}"
                timing = Timing(time.monotonic())
                async for out in self.generator.stream(prompt, job.params, rid, timing):
                    which = [p * n + i for i in range(n)] if out.index < 0 else [p * n + out.index]
                    await queue.put((which, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put(exc)
                return
            await queue.put(None)

        tasks = [asyncio.create_task(run(p, prompt)) for p, prompt in enumerate(job.prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(self, job: Job, chat: bool) -> dict[str, Any]:
        tallies: dict[int, ChoiceTally] = {}
        async for which, out in self._choices(job):
            if out.finish_reason == "error":
                raise failure(out)
            for index in which:
                tally = tallies.setdefault(index, ChoiceTally())
                if tally.final is None:
                    tally.add(out)
            if out.finish_reason == "abort":
                raise self._aborted(tallies)
        choices = [self._choice(index, tallies[index], chat, job) for index in sorted(tallies)]
        return {
            "id": job.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": choices,
            "usage": usage(tallies, job.params.n),
        }

    def _aborted(self, tallies: dict[int, ChoiceTally]) -> ApiError:
        done = sum(t.num_output_tokens for t in tallies.values())
        what = "the server shut down" if self.generator.draining else "the request was aborted"
        code = "shutting_down" if self.generator.draining else "engine_error"
        return ApiError(code, f"{what} before it finished ({done} tokens were generated)")

    def _choice(self, index: int, tally: ChoiceTally, chat: bool, job: Job) -> dict[str, Any]:
        if chat:
            choice = {"index": index, "message": {"role": "assistant", "content": tally.text}}
        else:
            choice = {"index": index, "text": tally.text}
        top = job.top_logprobs
        return choice | {
            "logprobs": logprobs_json(tally.rows, chat, top) if top is not None else None,
            "finish_reason": tally.final.finish_reason,
            "stop_reason": tally.final.stop_reason,
        }

    async def _stream(self, job: Job, chat: bool) -> Response:
        stream = self._choices(job)
        first = await anext(stream, None)  # refusals become an HTTP error, not a stream
        if first is not None and first[1].finish_reason == "error":
            await stream.aclose()
            raise failure(first[1])
        return StreamingResponse(
            self._sse(job, chat, first, stream), media_type="text/event-stream"
        )

    async def _sse(self, job: Job, chat: bool, first, stream) -> AsyncIterator[str]:
        head = {
            "id": job.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
        }
        tallies: dict[int, ChoiceTally] = {}
        items = _prepend(first, stream)
        try:
            async for which, out in items:
                if out.finish_reason == "error":
                    yield sse({"error": failure(out).openai_body()["error"]})
                    break
                for index in which:
                    tally = tallies.setdefault(index, ChoiceTally())
                    if tally.final is None:
                        tally.add(out)
                        first_chunk = len(tally.texts) == 1
                        choice = self._chunk(index, out, chat, job, first_chunk)
                        yield sse({**head, "choices": [choice]})
            if job.include_usage:
                yield sse({**head, "choices": [], "usage": usage(tallies, job.params.n)})
            yield "data: [DONE]\n\n"
        finally:
            await items.aclose()

    def _chunk(
        self, index: int, out: OutputDelta, chat: bool, job: Job, first: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["delta"] = (
                {"role": "assistant", "content": out.text} if first else {"content": out.text}
            )
        else:
            choice["text"] = out.text
        rows, top = out.logprobs or (), job.top_logprobs
        choice["logprobs"] = logprobs_json(rows, chat, top) if top is not None and rows else None
        choice["finish_reason"] = out.finish_reason
        if out.finish_reason is not None:
            choice["stop_reason"] = out.stop_reason
        return choice


def _prompts(prompt: Any) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return list(prompt)
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists (non-empty)",
        "prompt",
    )


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any | None:
    """`work`'s result, or None once the client hangs up first (then `work` is
    cancelled, which aborts its engine requests: no zombie decoding)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        gone.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    logger.info("client of %s hung up; its request was aborted", request.url.path)
    return None


async def _client_gone(request: Request) -> None:
    """Returns when the server learns that the client disconnected (its body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _prepend(first, stream):
    if first is not None:
        yield first
        async for item in stream:
            yield item
