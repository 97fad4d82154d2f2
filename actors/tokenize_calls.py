"""`TokenizeCalls`: an engine client's tokenize and detokenize calls, each waiting for
the tokenizer actor's answer."""

from __future__ import annotations

import asyncio

from actors.actor import send_message
from actors.transport import Outbox
from engine.errors import EngineBusy
from engine.messages import (
    DetokenizeRequest,
    ErrorKind,
    OutputDelta,
    TokenizeRequest,
    TokenizeResult,
)


class TokenizeCalls:
    """The calls waiting for an answer, by request id (`in` tells one).

    `call(message, outbox)` sends `message` and waits for its answer: the TokenizeResult,
    or EngineBusy for a call refused for load, ValueError for input refused. `answer(out)`
    hands a TokenizeResult, or the OutputDelta that fails the call (the tokenizer actor's
    failure rule: RuntimeError), to its caller if it still waits; `fail(error)` ends
    every waiting call with RuntimeError(error)."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[TokenizeResult]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    async def call(
        self, message: TokenizeRequest | DetokenizeRequest, outbox: Outbox
    ) -> TokenizeResult:
        rid = message.request_id
        answer = self._waiting[rid] = asyncio.get_running_loop().create_future()
        try:
            await send_message(outbox, message)
            result = await answer
        finally:
            del self._waiting[rid]
        if result.error_kind is ErrorKind.BUSY:
            raise EngineBusy(result.error)
        if result.error is not None:
            raise ValueError(result.error)
        return result

    def answer(self, out: TokenizeResult | OutputDelta) -> None:
        answer = self._waiting.get(out.request_id)
        if answer is None or answer.done():
            return  # its caller left
        if isinstance(out, TokenizeResult):
            answer.set_result(out)
        else:
            answer.set_exception(RuntimeError(out.error or "tokenizing failed"))

    def fail(self, error: str) -> None:
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(RuntimeError(error))
