"""`EngineClient`: what web/ talks to, whichever engine serves.

One engine (`AsyncEngine`), one that comes back after its worker dies
(`RestartingEngine`), and N data-parallel replicas (`ReplicaSet`) all implement it; the
web layer is typed against it alone. The contract is written here; implementations stay
terse.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from actors.engine_status import EngineStatus
from actors.supervisor import WatchStats
from engine.core.stats import EngineStats
from engine.messages import ChatInput, OutputDelta, PromptInput, TokenizeResult, WorkerReady
from engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    """An engine as web/ sees it. Every stream `generate` yields ends: with each
    sequence's finish reason, or with one request-wide OutputDelta (index -1) saying
    "abort" or "error" (`error_kind` says whose fault). Calls that refuse their input
    raise ValueError naming the field; calls made while the engine does not serve raise
    RuntimeError, and a tokenize call refused for load EngineBusy (one to retry)."""

    @property
    def ready(self) -> WorkerReady:
        """What the worker found at start-up (context length, blocks, attention backend)."""
        ...

    @property
    def status(self) -> EngineStatus:
        """OK or DEGRADED while it serves; RESTARTING or UNHEALTHY while it does not."""
        ...

    @property
    def is_healthy(self) -> bool:
        """It serves new requests."""
        ...

    @property
    def error(self) -> str | None:
        """Why it does not serve; None while it does."""
        ...

    def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """Yields incremental outputs for a text, token ids or a chat ({"role",
        "content"} dicts) until every sequence (`params.n`, each under its `index`) has a
        finish reason, or a request-wide one (index -1) arrives. `request_id`: minted
        when None; ValueError when invalid or already in flight. Leaving the stream early
        aborts the request. `strict_max_tokens`: see GenerateRequest."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stops a request; its stream (if still read) ends with finish_reason "abort".
        An unknown id is ignored."""
        ...

    async def tokenize(
        self,
        prompt: str | ChatInput,
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> TokenizeResult:
        """A text's token ids (`add_special_tokens`: BOS and the like), or a chat's
        (through the chat template), as `generate` would tokenize them, with each
        token's text."""
        ...

    async def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool = False
    ) -> TokenizeResult:
        """The text of `token_ids` (special tokens kept unless skipped), with each
        token's text."""
        ...

    async def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """How many prompt tokens chat `messages` would take (the chat template
        applied); ValueError when they cannot be rendered."""
        ...

    def stats(self) -> EngineStats:
        """The engine core's stats: the keys `LLM.stats()` has (replicas' merged)."""
        ...

    def watch_stats(self) -> WatchStats:
        """What the supervisor sees: timeouts, request ages, worker silence, restarts."""
        ...

    def replica_statuses(self) -> tuple[EngineStatus, ...]:
        """Each data-parallel replica's status (one engine: one replica)."""
        ...

    def replica_stats(self) -> tuple[EngineStats, ...]:
        """Each data-parallel replica's own stats."""
        ...

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine (no orphan processes, no stale ipc files); idempotent."""
        ...
