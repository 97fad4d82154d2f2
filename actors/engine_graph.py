"""`EngineGraph`: one engine's control-plane actors, wired once.

The block manager, scheduler and tokenizer actors run on the caller's event loop. The
block manager is reached through in-process pairs (its traffic, and its answers on a
reply inbox of the scheduler's own). The scheduler reads the inbox it is given: an ipc
socket when the workers are processes, so that worker results and the tokenizer's
requests arrive through one typed inbox. The tokenizer sends requests to the scheduler
through the outbox it is given, and each client's outputs to that client's outbox.

Without a tokenizer (`TokenizerWiring` None) the graph is the scheduler and the block
manager alone: what the scheduler sends the tokenizer waits in `tokenizer_inbox`, for a
control-plane benchmark or a test to read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from actors.actor import Actor, send_message
from actors.block_manager_actor import BlockManagerActor
from actors.scheduler_actor import SchedulerActor
from actors.tokenizer_actor import TokenizerActor
from actors.transport import Inbox, Outbox, inproc_pair
from engine.core.engine_core import EngineCore
from engine.kv.block_manager import BlockManager
from engine.messages import Shutdown
from engine.text.text_processor import TextProcessor


@dataclass(frozen=True)
class TokenizerWiring:
    """The tokenizer actor's part of the graph: its text `processor`, the outbox to the
    scheduler's inbox, and one outbox per client id (the actor closes them all when it
    stops)."""

    processor: TextProcessor
    to_scheduler: Outbox
    clients: dict[str, Outbox]


class EngineGraph:
    """The actors of one engine, built once from its parts (see the module doc): the
    scheduler plans for `core` on `scheduler_inbox` and sends every plan to every outbox
    of `to_workers`, one step ahead at `pipeline_depth` 2 (1: synchronous); the block
    manager actor holds `block_manager`, the authoritative block tables.

    `start()` starts the actors (block manager, scheduler, tokenizer); `stop()` stops
    them in the reverse order, which closes their transports (`to_workers` among them);
    `shut_down_workers()` asks every worker to exit. Clients send to the tokenizer
    through `to_tokenizer`; `actors` are the graph's actors, for a supervisor."""

    def __init__(
        self,
        core: EngineCore,
        block_manager: BlockManager,
        scheduler_inbox: Inbox,
        to_workers: list[Outbox],
        pipeline_depth: int = 2,
        tokenizer: TokenizerWiring | None = None,
    ) -> None:
        self.to_workers = to_workers
        self.to_tokenizer, self.tokenizer_inbox = inproc_pair()
        to_blocks, blocks_inbox = inproc_pair()
        to_replies, replies_inbox = inproc_pair()
        self.block_manager = BlockManagerActor(block_manager, blocks_inbox, to_replies)
        self.scheduler = SchedulerActor(
            core,
            scheduler_inbox,
            to_workers,  # every rank runs every plan; rank 0 answers
            self.to_tokenizer,
            to_blocks,
            replies_inbox,
            pipeline_depth,
        )
        self.tokenizer: TokenizerActor | None = None
        if tokenizer is not None:
            self.tokenizer = TokenizerActor(
                tokenizer.processor, self.tokenizer_inbox, tokenizer.to_scheduler, tokenizer.clients
            )

    @property
    def actors(self) -> tuple[Actor, ...]:
        """Tokenizer (when there is one), scheduler, block manager."""
        return tuple(
            actor
            for actor in (self.tokenizer, self.scheduler, self.block_manager)
            if actor is not None
        )

    async def start(self) -> None:
        for actor in reversed(self.actors):
            await actor.start()

    async def stop(self) -> None:
        for actor in self.actors:
            await actor.stop()

    async def shut_down_workers(self, reason: str) -> None:
        """Sends every worker a Shutdown (an outbox that cannot send is skipped)."""
        for to_worker in self.to_workers:
            with contextlib.suppress(Exception):
                await send_message(to_worker, Shutdown(reason))
