"""A Response object (OpenAI's Responses API) from a chat completion of one choice."""

from __future__ import annotations

import time
import uuid
from typing import Any


def response_of(
    completion: dict[str, Any], body: dict[str, Any], response_id: str | None = None
) -> dict[str, Any]:
    """A chat completion (one choice) as the Response to `body` (its id `response_id`,
    else a fresh one)."""
    [choice] = completion["choices"]
    cut = choice["finish_reason"] == "length"
    usage = completion["usage"]
    return {
        "id": response_id or "resp_" + uuid.uuid4().hex,
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
