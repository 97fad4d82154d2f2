"""OpenAI-compatible HTTP: /v1/completions and /v1/chat/completions, plain and SSE.

`n` choices of a prompt run as one engine request sampling n (or `best_of`) sequences on
the prompt's shared blocks (a seeded request gives sequence i the seed `seed + i`).
vLLM's `use_beam_search` (with `length_penalty`, `early_stopping`; width `best_of`, else
`n`) returns the n best beams, each choice whole when the search ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.messages import LogprobRow, OutputDelta
from engine.sampling_params import SamplingParams
from web.errors import ApiError, invalid
from web.generation import Generator, PromptInput, Timing
from web.params import (
    BEAM_FIELDS,
    SAMPLING_FIELDS,
    best_of,
    chat_messages,
    num_choices,
    sampling_params,
)
from web.server_config import ServerConfig

_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "logit_bias", "user"}
_COMMON |= {*SAMPLING_FIELDS, *BEAM_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


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
            job = self._parse(await _json_body(request, self.config.max_message_bytes), chat)
            if job.stream:
                return await self._stream(job, chat)
            return JSONResponse(await self._complete(job, chat))
        except ApiError as err:
            headers = {"Retry-After": "1"} if err.code == "overloaded" else None
            return JSONResponse(err.openai_body(), err.status, headers=headers)

    # -- parsing -------------------------------------------------------------------
    def _parse(self, body: dict[str, Any], chat: bool) -> Job:
        allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise invalid(f"unknown field(s) {unknown}", unknown[0])
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            raise ApiError(
                "not_found",
                f"model {model!r} is not served here; this server "
                f"serves {self.config.model_name!r}",
                "model",
            )
        for name in ("echo", "suffix"):
            if body.get(name):
                raise invalid(f"{name} is not supported", name)
        n = num_choices(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise invalid(f"stream must be a bool, got {stream!r}", "stream")
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
    async def _choices(self, job: Job) -> AsyncIterator[tuple[int, OutputDelta]]:
        """All choices' deltas as they come, tagged with the choice index."""
        queue: asyncio.Queue[tuple[int, OutputDelta] | BaseException | None] = asyncio.Queue()
        n = job.params.n

        async def run(p: int, prompt: PromptInput) -> None:
            try:
                rid = f"{job.request_id}-{p}"
                timing = Timing(time.monotonic())
                async for out in self.generator.stream(prompt, job.params, rid, timing):
                    await queue.put((p * n + max(out.index, 0), out))
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
        texts: dict[int, list[str]] = {}
        rows: dict[int, list[LogprobRow]] = {}
        finals: dict[int, OutputDelta] = {}
        async for index, out in self._choices(job):
            _raise_failed(out)
            texts.setdefault(index, []).append(out.text)
            rows.setdefault(index, []).extend(out.logprobs or ())
            if out.finish_reason is not None:
                finals[index] = out
        choices = []
        for index in sorted(finals):
            out, text = finals[index], "".join(texts[index])
            logprobs = (
                self._logprobs(rows[index], chat, job.top_logprobs)
                if job.top_logprobs is not None
                else None
            )
            if chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": index, "text": text}
            choice |= {
                "logprobs": logprobs,
                "finish_reason": _finish(out),
                "stop_reason": out.stop_reason,
            }
            choices.append(choice)
        return {
            "id": job.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": choices,
            "usage": _usage(finals),
        }

    async def _stream(self, job: Job, chat: bool) -> Response:
        stream = self._choices(job)
        first = await _first_or_error(stream)  # refusals become an HTTP error, not a stream
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
        finals: dict[int, OutputDelta] = {}
        started: set[int] = set()
        items = _prepend(first, stream)
        try:
            async for index, out in items:
                if out.finish_reason == "error":
                    yield _sse(
                        {
                            "error": ApiError("engine_error", out.error or "failed").openai_body()[
                                "error"
                            ]
                        }
                    )
                    break
                choice: dict[str, Any] = {"index": index}
                if chat:
                    delta = {"content": out.text}
                    if index not in started:
                        delta["role"] = "assistant"
                    choice["delta"] = delta
                else:
                    choice["text"] = out.text
                started.add(index)
                rows = out.logprobs or ()
                choice["logprobs"] = (
                    self._logprobs(rows, chat, job.top_logprobs)
                    if job.top_logprobs is not None and rows
                    else None
                )
                choice["finish_reason"] = _finish(out)
                if out.finish_reason is not None:
                    finals[index] = out
                    choice["stop_reason"] = out.stop_reason
                chunk = {**head, "choices": [choice]}
                if job.include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            if job.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finals)})
            yield "data: [DONE]\n\n"
        finally:
            await items.aclose()

    def _logprobs(self, rows, chat: bool, k: int) -> dict[str, Any]:
        if chat:
            return {"content": [_chat_logprob(row, self._top(row, k)) for row in rows]}
        return {
            "tokens": [row[0].decoded_token for row in rows],
            "token_logprobs": [row[0].logprob for row in rows],
            "top_logprobs": [
                {c.decoded_token: c.logprob for c in self._top(row, k)} for row in rows
            ],
            "text_offset": None,
        }

    @staticmethod
    def _top(row: LogprobRow, k: int) -> list:
        """The row's top-k candidates by rank (the sampled token may rank below them)."""
        return sorted((c for c in row if c.rank is not None and c.rank <= k), key=lambda c: c.rank)


def _chat_logprob(row: LogprobRow, top: list) -> dict[str, Any]:
    def entry(c) -> dict[str, Any]:
        token = c.decoded_token or ""
        return {"token": token, "logprob": c.logprob, "bytes": list(token.encode("utf-8"))}

    return {**entry(row[0]), "top_logprobs": [entry(c) for c in top]}


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


def _raise_failed(out: OutputDelta) -> None:
    if out.finish_reason == "error":
        raise ApiError("engine_error", out.error or "the request failed")


def _finish(out: OutputDelta) -> str | None:
    return {"abort": "stop"}.get(out.finish_reason, out.finish_reason)


def _usage(finals: dict[int, OutputDelta]) -> dict[str, int]:
    prompt = sum(o.num_prompt_tokens for o in finals.values())
    completion = sum(o.num_output_tokens for o in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _first_or_error(stream):
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def _prepend(first, stream):
    if first is not None:
        yield first
        async for item in stream:
            yield item


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > limit:
        raise invalid(f"request body is {len(raw)} bytes; the limit is {limit}")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise invalid(f"request body is not valid UTF-8: {exc}") from None
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body
