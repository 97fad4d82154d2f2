"""`POST /v1/responses`: OpenAI's Responses API, stateless, served by the chat route.

The body is checked against its own field table (web/responses_fields.py), turned into
a chat completions body, completed whole, and the completion reshaped into a Response:
`output` holds a `reasoning` item (with `--reasoning-parser`), a `message` item with
one `output_text` part, and a `function_call` item per tool call; `status` is
`incomplete` (`incomplete_details.reason: "max_output_tokens"`) when the output was cut
by length. Errors are the chat route's, under the Responses field names."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from web.client_concurrency import Client
from web.errors import ApiError
from web.frames import read_json_body
from web.openai_fields import check_fields
from web.openai_routes import CLIENT_GONE, OpenAIRoutes, error_response, unless_disconnected
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


def response_of(completion: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (one choice) as a Response object."""
    [choice] = completion["choices"]
    cut = choice["finish_reason"] == "length"
    usage = completion["usage"]
    return {
        "id": "resp_" + uuid.uuid4().hex,
        "object": "response",
        "created_at": completion["created"],
        "completed_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": completion["model"],
        "output": _output(choice["message"], cut),
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "store": False,
        "background": False,
        "metadata": {},
        "user": body.get("user"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def _output(message: dict[str, Any], cut: bool) -> list[dict[str, Any]]:
    status = "incomplete" if cut else "completed"
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(
            {
                "type": "reasoning",
                "id": "rs_" + uuid.uuid4().hex,
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                "status": status,
            }
        )
    if message.get("content") or not message.get("tool_calls"):
        text = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        items.append(
            {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex,
                "status": status,
                "role": "assistant",
                "content": [text],
            }
        )
    for call in message.get("tool_calls") or ():
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex,
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": status,
            }
        )
    return items
