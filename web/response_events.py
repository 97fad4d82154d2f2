"""A streamed chat completion's chunks -> the Responses API's stream events.

Events, each with its `type` and a `sequence_number` counting from 0:
`response.created` and `response.in_progress` first; then per output item, in the order
the text brings them (a reasoning item, a message, one function call per tool call):
`response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.content_part.added` then `response.output_text.delta`,
`response.function_call_arguments.delta`), and its `.done` events once the next item
starts or the output ends (`response.output_item.done` last); finally
`response.completed` (or `response.incomplete`, cut by length) holding the whole
Response, whose items carry the ids the events used. A failure mid-stream is an `error`
event, and nothing follows it."""

from __future__ import annotations

import uuid
from typing import Any

from web.response_object import response_of


class ResponseEvents:
    """One response's events, built from chat chunks fed in order. Contract: `start()`
    once, `feed(chunk)` per chat chunk, then `finish()`; each returns the events to
    send now."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.body, self.model = body, model
        self.id = "resp_" + uuid.uuid4().hex
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output so far, ids fixed
        self.open: dict[str, Any] | None = None  # the item whose deltas are arriving
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.reason: str | None = None
        self.usage: dict[str, int] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        self.created = 0
        self.failed = False

    def start(self) -> list[dict[str, Any]]:
        skeleton = self._response("in_progress")
        return [
            self._event("response.created", response=skeleton),
            self._event("response.in_progress", response=skeleton),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            self.failed = True
            return [self._event("error", **chunk["error"])]
        self.created = chunk.get("created", self.created)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.reason = choice.get("finish_reason") or self.reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        if self.failed:
            return []
        events = self._close()
        cut = self.reason == "length"
        response = self._response("incomplete" if cut else "completed")
        return [
            *events,
            self._event("response.incomplete" if cut else "response.completed", response=response),
        ]

    # -- items ------------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._add(kind)
        item = self.open
        part = item["content"][0]
        part["text"] += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(
            self._event(
                name,
                item_id=item["id"],
                output_index=self._index(item),
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _add(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = {
                "type": "reasoning",
                "id": "rs_" + uuid.uuid4().hex,
                "summary": [],
                "content": [part],
                "status": "in_progress",
            }
        else:
            part = {"type": "output_text", "text": "", "annotations": []}
            item = {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex,
                "status": "in_progress",
                "role": "assistant",
                "content": [part],
            }
        self.items.append(item)
        self.open = item
        index = self._index(item)
        added = {**item, "content": [] if kind == "message" else [dict(part)]}
        events = [self._event("response.output_item.added", output_index=index, item=added)]
        if kind == "message":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = delta["index"]
        if index not in self.calls:
            events += self._close()
            function = delta.get("function", {})
            item = {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex,
                "call_id": delta.get("id"),
                "name": function.get("name"),
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            self.calls[index] = self.open = item
            events.append(
                self._event(
                    "response.output_item.added", output_index=self._index(item), item=dict(item)
                )
            )
        item = self.calls[index]
        fragment = (delta.get("function") or {}).get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._index(item),
                    delta=fragment,
                )
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The `.done` events of the open item (if any)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "incomplete" if self.reason == "length" else "completed"
        index = self._index(item)
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    # -- envelope ---------------------------------------------------------------------
    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _response(self, status: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": None}
        completion = {
            "created": self.created,
            "model": self.model,
            "choices": [{"message": message, "finish_reason": self.reason}],
            "usage": self.usage,
        }
        response = response_of(completion, self.body, self.id)
        output = [dict(item) for item in self.items] if status != "in_progress" else []
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**response, "status": status, "output": output, "incomplete_details": incomplete}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event
