"""`POST /v1/responses`: OpenAI's Responses API, stateless, served by the chat route.

The body is checked against its own field table (web/responses_fields.py), turned into
a chat completions body, completed whole, and the completion reshaped into a Response:
`output` holds a `reasoning` item (with `--reasoning-parser`), a `message` item with
one `output_text` part, and a `function_call` item per tool call; `status` is
`incomplete` (`incomplete_details.reason: "max_output_tokens"`) when the output was cut
by length. `stream: true` sends the Responses events (web/response_events.py). Errors
are the chat route's, under the Responses field names."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from web.client_concurrency import Client
from web.errors import ApiError
from web.frames import read_json_body
from web.openai_fields import check_fields
from web.openai_routes import CLIENT_GONE, OpenAIRoutes, error_response, unless_disconnected
from web.response_events import ResponseEvents
from web.response_object import response_of
from web.responses_fields import RESPONSES_RULES, chat_body, renamed
from web.server_config import ServerConfig

logger = logging.getLogger(__name__)


class ResponsesRoute:
    """The one Responses route, over the chat completions route."""

    def __init__(self, chat: OpenAIRoutes, config: ServerConfig) -> None:
        self.chat, self.config = chat, config

    async def responses(self, request: Request) -> Response:
        authorization = request.headers.getlist("authorization")
        client = Client.of_http(self.config.api_keys, authorization, request.client)
        try:
            body = await read_json_body(request, self.config.max_message_bytes)
            check_fields(body, RESPONSES_RULES)
            if body.get("stream") is True:
                chunks = await self.chat.stream_chat(chat_body(body), client)
                events = ResponseEvents(body, self.config.model_name)
                return StreamingResponse(_sse(events, chunks), media_type="text/event-stream")
            work = self.chat.complete_chat(chat_body(body), client)
            completion = await unless_disconnected(request, work)
            if completion is None:
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(response_of(completion, body))
        except ApiError as err:
            return error_response(renamed(err))
        except Exception:  # a bug, never the client's input: logged, answered, served on
            logger.exception("%s failed", request.url.path)
            return error_response(
                ApiError("engine_error", "internal error while handling the request")
            )


async def _sse(events: ResponseEvents, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The events as server-sent events (`event: TYPE`, `data: JSON`)."""
    try:
        for event in events.start():
            yield _frame(event)
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield _frame(event)
        for event in events.finish():
            yield _frame(event)
    finally:
        await chunks.aclose()


def _frame(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
