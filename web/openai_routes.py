"""OpenAI-compatible HTTP: /v1/completions and /v1/chat/completions, plain and SSE.

`n` choices of a prompt run as one engine request sampling n (or `best_of`) sequences on
the prompt's shared blocks (a seeded request gives sequence i the seed `seed + i`).
vLLM's `use_beam_search` (with `length_penalty`, `early_stopping`; width `best_of`, else
`n`) returns the n best beams, each choice whole when the search ends. Which fields each
route takes, with which values, is web/openai_fields.py's table: nothing sent is
ignored. Structured outputs, in any of their spellings (`response_format`,
`structured_outputs`, `guided_*`), become the request's one StructuredOutputsParams
(web/structured_fields.py); their errors name the field as the client spelled it.

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

from engine.messages import ChatPrompt, OutputDelta, PromptInput
from engine.sampling_params import SamplingParams
from web.chat_reply import ChatReplyShape, finish_reason
from web.choice_chunks import ChoiceChunks, ChunkShape
from web.client_concurrency import Client
from web.completion_echo import PromptEcho, prompt_echoes
from web.errors import ApiError, invalid
from web.frames import read_json_body
from web.generation import Generator, Timing, failure
from web.openai_fields import CHAT_RULES, COMPLETION_RULES, accepted, check_fields
from web.openai_format import (
    ChoiceTally,
    chat_logprobs,
    completion_logprobs,
    echo_entries,
    entries,
    sse,
    usage,
)
from web.params import (
    best_of,
    chat_messages,
    flag,
    num_choices,
    sampling_params,
    stream_options,
    template_kwargs,
    user_of,
)
from web.server_config import ServerConfig
from web.structured_fields import respell
from web.tool_choice import respell_tools, with_tool_choice
from web.tool_fields import tool_request

logger = logging.getLogger(__name__)
COMPLETION_FIELDS = accepted(COMPLETION_RULES)  # some with some values only (the table)
CHAT_FIELDS = accepted(CHAT_RULES)
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
    client: Client  # whose open requests it counts among (--max-concurrent-per-key)
    echo: bool = False  # completions: the prompt before each choice
    strict_max_tokens: bool = False  # the client chose max_tokens: refused past the context
    reply: ChatReplyShape | None = None  # chat: how each choice's text becomes a message

    @property
    def echo_logprobs(self) -> bool:
        return self.echo and self.top_logprobs is not None


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
        body = None
        authorization = request.headers.getlist("authorization")
        client = Client.of_http(self.config.api_keys, authorization, request.client)
        try:
            body = await read_json_body(request, self.config.max_message_bytes)
            job = self._parse(body, chat, client)
            echoes = None
            if job.echo:
                skip = job.params.skip_special_tokens
                engine = self.generator.engine
                echoes = await prompt_echoes(engine, job.prompts, job.echo_logprobs, skip)
            if job.stream:
                return await self._stream(job, chat, echoes)
            work = self._complete(job, chat, echoes)
            result = await unless_disconnected(request, work)
            return JSONResponse(result) if result is not None else Response(status_code=CLIENT_GONE)
        except ApiError as err:
            if chat and err.param == "max_tokens" and _given(body, "max_completion_tokens"):
                err.param = "max_completion_tokens"  # the field this client sent
            err = respell(err, body)  # structured outputs: as this client spelled them
            return error_response(respell_tools(err, body))  # a tool choice's grammar: tools
        except Exception:  # a bug, never the client's input: logged, answered, served on
            logger.exception("%s failed", request.url.path)
            return error_response(
                ApiError("engine_error", "internal error while handling the request")
            )

    async def complete_chat(self, body: dict[str, Any], client: Client) -> dict[str, Any]:
        """A whole chat completion for `body` (not streamed), or an ApiError: what
        another route built on chat completions runs (/v1/responses)."""
        job = self._parse(body, True, client)
        return await self._complete(job, True, None)

    # -- parsing -------------------------------------------------------------------
    def _parse(self, body: dict[str, Any], chat: bool, client: Client) -> Job:
        check_fields(body, CHAT_RULES if chat else COMPLETION_RULES)
        check_model(body, self.config.model_name)
        n = num_choices(body)
        stream = flag(body, "stream", False)
        include_usage = stream_options(body, stream)
        ranked = best_of(body, n, stream)
        echo = not chat and flag(body, "echo", False)  # chat: only false (the table)
        user = user_of(body)
        base = sampling_params(body, chat=chat, default_max_tokens=self.config.default_max_tokens)
        params = dataclasses.replace(base, n=n, best_of=ranked)
        reply = None
        if chat:
            chat_prompt, params, reply = self._chat(body, params)
            prompts: list[PromptInput] = [chat_prompt]
        else:
            prompts = _prompts(body.get("prompt"))
        top = base.logprobs  # chat's logprobs: true alone is 0: the chosen token's own
        if echo and top is not None:  # the prompt's tokens, scored, before each choice's
            params = dataclasses.replace(params, prompt_logprobs=top)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if user is not None:
            logger.info("%s is from user %r", request_id, user)
        strict = _given(body, "max_tokens") or _given(body, "max_completion_tokens")
        return Job(
            request_id, prompts, params, stream, include_usage, top, client, echo, strict, reply
        )

    def _chat(
        self, body: dict[str, Any], params: SamplingParams
    ) -> tuple[ChatPrompt, SamplingParams, ChatReplyShape]:
        """A chat body's prompt (messages, tools, template kwargs), its params with the
        grammar its tool choice needs, and the shape of its replies."""
        parsing = self.config.chat_parsing
        tools = tool_request(body, parsing)
        params = with_tool_choice(params, tools, parsing, body)
        prompt = ChatPrompt.of(
            chat_messages(body.get("messages")),
            tools=None if tools is None else tools.tools,
            chat_template_kwargs=template_kwargs(body),
        )
        reply = ChatReplyShape.of(
            tools,
            parsing,
            include_reasoning=flag(body, "include_reasoning", True),
            constrained=params.structured_outputs is not None,
        )
        return prompt, params, reply

    # -- running -------------------------------------------------------------------
    async def _choices(self, job: Job) -> AsyncIterator[tuple[list[int], OutputDelta]]:
        """All choices' deltas as they come, each with the choice indices it is about
        (one, or every choice of its prompt for a request-wide end: abort, error). The
        job counts as one of its client's open requests until this ends (refused with
        429 first when the client is at its cap)."""
        queue: asyncio.Queue[tuple[list[int], OutputDelta] | BaseException | None]
        queue = asyncio.Queue()
        n = job.params.n

        async def run(p: int, prompt: PromptInput) -> None:
            try:
                rid = f"{job.request_id}-{p}"
                timing = Timing(time.monotonic())
                outs = self.generator.stream(
                    prompt, job.params, rid, timing, strict_max_tokens=job.strict_max_tokens
                )
                async for out in outs:
                    which = [p * n + i for i in range(n)] if out.index < 0 else [p * n + out.index]
                    await queue.put((which, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put(exc)
                return
            await queue.put(None)

        concurrency = self.generator.concurrency
        concurrency.acquire(job.client)
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = [asyncio.create_task(run(p, prompt)) for p, prompt in enumerate(job.prompts)]
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
            concurrency.release(job.client)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(
        self, job: Job, chat: bool, echoes: list[PromptEcho] | None
    ) -> dict[str, Any]:
        tallies: dict[int, ChoiceTally] = {}
        async with contextlib.aclosing(self._choices(job)) as deltas:  # ends its count now
            async for which, out in deltas:
                if out.finish_reason == "error":
                    raise failure(out)
                for index in which:
                    tally = tallies.setdefault(index, ChoiceTally())
                    if tally.final is None:
                        tally.add(out)
                if out.finish_reason == "abort":
                    raise self._aborted(tallies)
        prompt_rows: dict[int, list] = {}  # per prompt: whichever choice got them
        for index in sorted(tallies):
            if tallies[index].prompt_rows:
                prompt_rows.setdefault(index // job.params.n, tallies[index].prompt_rows)
        choices = []
        for index in sorted(tallies):
            p = index // job.params.n
            echo = None if echoes is None else (echoes[p], prompt_rows.get(p, ()))
            choices.append(self._choice(index, tallies[index], chat, job, echo))
        reply = {
            "id": job.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": choices,
            "usage": usage(tallies, job.params.n),
        }
        handoff = next((t.final.kv_transfer_params for t in tallies.values()), None)
        if handoff is not None:  # a prefill instance: where the decode instance finds the KV
            reply["kv_transfer_params"] = handoff.to_dict()
        return reply

    def _aborted(self, tallies: dict[int, ChoiceTally]) -> ApiError:
        done = sum(t.num_output_tokens for t in tallies.values())
        what = "the server shut down" if self.generator.draining else "the request was aborted"
        code = "shutting_down" if self.generator.draining else "engine_error"
        return ApiError(code, f"{what} before it finished ({done} tokens were generated)")

    def _choice(
        self, index: int, tally: ChoiceTally, chat: bool, job: Job, echo: tuple | None
    ) -> dict[str, Any]:
        """One choice of a whole reply; `echo`: its prompt's PromptEcho and logprob rows."""
        top = job.top_logprobs
        logprobs = None
        reason = tally.final.finish_reason
        if chat:
            message, calls_tools = job.reply.message(tally.text)
            choice = {"index": index, "message": message}
            logprobs = None if top is None else chat_logprobs(tally.rows, top)
            reason = finish_reason(reason, calls_tools)
        else:
            text, head = tally.text, []
            if echo is not None:
                text = echo[0].text + text
                head = echo_entries(echo[0].first_token, echo[1], top) if job.echo_logprobs else []
            choice = {"index": index, "text": text}
            if top is not None:
                logprobs = completion_logprobs([*head, *entries(tally.rows, top)])
        return choice | {
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": tally.final.stop_reason,
        }

    async def _stream(self, job: Job, chat: bool, echoes: list[PromptEcho] | None) -> Response:
        chunks = await self._chunk_stream(job, chat, echoes)
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    async def stream_chat(
        self, body: dict[str, Any], client: Client
    ) -> AsyncIterator[dict[str, Any]]:
        """A streamed chat completion for `body`, as chunk dicts (the last with usage;
        an engine failure mid-stream as `{"error": ...}`), or an ApiError before the
        first: what another route built on chat completions streams (/v1/responses)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        return await self._chunk_stream(self._parse(body, True, client), True, None)

    async def _chunk_stream(
        self, job: Job, chat: bool, echoes: list[PromptEcho] | None
    ) -> AsyncIterator[dict[str, Any]]:
        stream = self._choices(job)
        first = await anext(stream, None)  # refusals become an HTTP error, not a stream
        if first is not None and first[1].finish_reason == "error":
            await stream.aclose()
            raise failure(first[1])
        return self._chunks(job, chat, echoes, first, stream)

    async def _chunks(self, job: Job, chat: bool, echoes, first, stream) -> AsyncIterator[dict]:
        head = {
            "id": job.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
        }
        tallies: dict[int, ChoiceTally] = {}
        shape = ChunkShape(chat, job.params.n, job.top_logprobs, job.echo_logprobs, job.reply)
        chunks = ChoiceChunks(shape, echoes, tallies)
        items = _prepend(first, stream)
        try:
            async for which, out in items:
                if out.finish_reason == "error":
                    yield {"error": failure(out).openai_body()["error"]}
                    break
                for index in which:
                    tally = tallies.setdefault(index, ChoiceTally())
                    if tally.final is None:
                        tally.add(out)
                        for choice in chunks.ready(index, out):
                            yield {**head, "choices": [choice]}
            for choice in chunks.drain():
                yield {**head, "choices": [choice]}
            if job.include_usage:
                yield {**head, "choices": [], "usage": usage(tallies, job.params.n)}
        finally:
            await items.aclose()
            await stream.aclose()  # its client's count ends with it


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Chunks as server-sent events, then `[DONE]`."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()


def error_response(err: ApiError) -> JSONResponse:
    """An ApiError in OpenAI's shape, with Retry-After for 429/503 and Connection: close
    when the connection should not be reused."""
    headers = {"Retry-After": "1"} if err.status in (429, 503) else {}
    headers |= {"Connection": "close"} if err.close else {}
    return JSONResponse(err.openai_body(), err.status, headers=headers)


def _given(body: Any, name: str) -> bool:
    """Whether the body sets `name` (null is not set)."""
    return isinstance(body, dict) and body.get(name) is not None


def check_model(body: dict[str, Any], served: str) -> None:
    """A body's `model`, when given, must be the served model's name (404 otherwise)."""
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(
            "not_found",
            f"model {str(model)[:100]!r} is not served here; this server serves {served!r}",
            "model",
        )


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


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any | None:
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
