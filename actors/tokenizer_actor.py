"""The tokenizer actor: one TextProcessor between clients and the scheduler."""

from __future__ import annotations

import logging
import time

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox
from engine.messages import AbortRequest, GenerateRequest, OutputDelta, TokenDeltas
from engine.text_processor import TextProcessor

logger = logging.getLogger(__name__)


class TokenizerActor(Actor):
    """Tokenizes requests for the scheduler and streams text deltas to each client.

    A request that fails validation is answered at once with an `OutputDelta` carrying
    `finish_reason="error"` and the message; nothing reaches the scheduler. Deltas for a
    client without an outbox are logged and dropped.
    """

    def __init__(
        self,
        processor: TextProcessor,
        inbox: Inbox,
        scheduler: Outbox,
        clients: dict[str, Outbox],
    ) -> None:
        handlers = {
            GenerateRequest: self.on_generate,
            AbortRequest: self.on_abort,
            TokenDeltas: self.on_token_deltas,
        }
        super().__init__("tokenizer", inbox, handlers, [scheduler, *clients.values()])
        self.processor = processor
        self.scheduler = scheduler
        self.clients = clients

    async def on_generate(self, request: GenerateRequest) -> None:
        try:
            add = self.processor.admit(request, time.time())
        except ValueError as exc:
            error = OutputDelta(request.request_id, "", (), "error", None, 0, 0, str(exc), index=-1)
            await self._to_client(request.client_id, error)
            return
        await send_message(self.scheduler, add)

    async def on_abort(self, abort: AbortRequest) -> None:
        self.processor.drop(abort.request_id)
        await send_message(self.scheduler, abort)

    async def on_token_deltas(self, message: TokenDeltas) -> None:
        for delta in message.deltas():
            client = self.processor.client_of(delta.request_id)
            outs, abort = self.processor.on_token_delta(delta)
            if abort is not None:
                await send_message(self.scheduler, abort)
            for out in outs if client is not None else ():
                await self._to_client(client, out)
        if message.ranked:
            for client, out in self.processor.on_ranked(message.ranked, message.prompt_logprobs):
                await self._to_client(client, out)

    async def _to_client(self, client_id: str, delta: OutputDelta) -> None:
        outbox = self.clients.get(client_id)
        if outbox is None:
            logger.warning("no outbox for client %r; dropping %s", client_id, delta.request_id)
            return
        await send_message(outbox, delta)
