"""vLLM's `/tokenize`, `/detokenize` and `/version`.

- `POST /tokenize` `{"model"?, "prompt", "add_special_tokens"?: true, "return_token_strs"?:
  false}` or `{"model"?, "messages", "add_generation_prompt"?: true,
  "continue_final_message"?: false, "return_token_strs"?}` -> `{"count", "max_model_len",
  "tokens", "token_strs"}`: the token ids a completion or chat request with that prompt
  would run on (`token_strs`, when asked for: each token's text as it reads in running
  text; else null). A prompt longer than the context is tokenized all the same (this is
  how a client learns whether it fits).
- `POST /detokenize` `{"model"?, "tokens": [ids]}` -> `{"prompt": text}` (special tokens
  kept).
- `GET /version` -> `{"version": the pagedserve version}`.

Input is checked before the tokenizer sees it; every refusal is a 400 in OpenAI's error
shape naming the field. The tokenizing runs on the tokenizer actor's admission thread,
off the event loop.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.messages import TokenizeResult
from web.errors import ApiError, invalid
from web.frames import read_json_body
from web.generation import Generator
from web.openai_routes import check_model
from web.params import chat_messages, flag, only_keys, valid_text
from web.server_config import ServerConfig

logger = logging.getLogger(__name__)
PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
CHAT_FIELDS = {
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
}
DETOKENIZE_FIELDS = {"model", "tokens"}
_NAMED = ("prompt", "messages", "tokens")  # what a tokenizer's refusal starts with


def pagedserve_version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


class TokenizeRoutes:
    """The three routes; `max_model_len` is the served model's context."""

    def __init__(self, generator: Generator, config: ServerConfig, max_model_len: int) -> None:
        self.generator = generator
        self.config = config
        self.max_model_len = max_model_len

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pagedserve_version()})

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, self._detokenize)

    async def _answer(self, request: Request, handle) -> Response:
        try:
            body = await read_json_body(request, self.config.max_message_bytes)
            self._check_model(body)
            return JSONResponse(await handle(body))
        except ApiError as err:
            headers = {"Connection": "close"} if err.close else {}
            return JSONResponse(err.openai_body(), err.status, headers=headers)
        except Exception:  # a bug, never the client's input: logged, answered, served on
            logger.exception("%s failed", request.url.path)
            err = ApiError("engine_error", "internal error while handling the request")
            return JSONResponse(err.openai_body(), err.status)

    async def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            only_keys(body, CHAT_FIELDS, "a chat /tokenize request")
            messages = chat_messages(body["messages"])
            if flag(body, "continue_final_message", False):
                raise invalid(
                    "continue_final_message=true is not supported: a chat's tokens always "
                    "open a new assistant turn (with add_generation_prompt)",
                    "continue_final_message",
                )
            opening = flag(body, "add_generation_prompt", True)
            result = await self._call(
                self.generator.engine.tokenize(messages, add_generation_prompt=opening)
            )
        else:
            only_keys(body, PROMPT_FIELDS, "a /tokenize request")
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise invalid("prompt must be a string (or send messages instead)", "prompt")
            special = flag(body, "add_special_tokens", True)
            result = await self._call(
                self.generator.engine.tokenize(
                    valid_text("prompt", prompt), add_special_tokens=special
                )
            )
        strs = list(result.token_strs) if flag(body, "return_token_strs", False) else None
        return {
            "count": len(result.token_ids),
            "max_model_len": self.max_model_len,
            "tokens": list(result.token_ids),
            "token_strs": strs,
        }

    async def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        only_keys(body, DETOKENIZE_FIELDS, "a /detokenize request")
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise invalid("tokens must be a list of token ids (ints)", "tokens")
        result = await self._call(self.generator.engine.detokenize(tokens))
        return {"prompt": result.text}

    def _check_model(self, body: dict[str, Any]) -> None:
        check_model(body, self.config.model_name)

    async def _call(self, work) -> TokenizeResult:
        """The tokenizer's answer; its refusal as a 400 naming the field, an engine that
        cannot answer as a 503."""
        if self.generator.draining:
            work.close()
            raise ApiError("shutting_down", "the server is shutting down; retry elsewhere")
        try:
            return await work
        except ValueError as exc:
            message = str(exc)
            param = next((name for name in _NAMED if message.startswith(name)), None)
            raise invalid(message, param) from None
        except RuntimeError as exc:
            raise ApiError("unavailable", f"the engine cannot answer: {exc}") from None
