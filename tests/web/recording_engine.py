"""A stand-in engine that records what the web layer hands it: the routes' whole app
runs in-process around it (`recording_app`), with no worker and no model, so a test can
check the SamplingParams a request became, field by field.

Each request is answered with `reply` as one token per sequence (finish_reason "stop"),
each token's logprob row holding the chosen token and `params.logprobs` alternatives,
as the engine's rows do; with `refusal` set, every request is refused the way the
engine's validation refuses one (an `invalid_request` error delta carrying that
message)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette

from actors.engine_status import EngineStatus
from actors.supervisor import WatchStats
from engine.core.stats import EngineStats
from engine.messages import ErrorKind, OutputDelta, TokenLogprob, WorkerReady
from engine.sampling_params import SamplingParams
from web.app import Server, build_app
from web.server_config import ServerConfig

MODEL = "recorded"


@dataclass
class RecordingEngine:
    """The parts of `EngineClient` the generation routes use; `requests` holds each
    request's (prompt, SamplingParams) in arrival order."""

    reply: str = "ok"
    refusal: str | None = None
    pieces: tuple[str, ...] = ()  # set: the reply streams as these deltas, one token each
    requests: list[tuple[Any, SamplingParams]] = field(default_factory=list)
    ready: WorkerReady = field(
        default_factory=lambda: WorkerReady(
            worker_id=0, num_blocks=64, block_size=16, max_model_len=2048, vocab_size=258
        )
    )
    status: EngineStatus = EngineStatus.OK
    is_healthy: bool = True
    error: str | None = None

    @property
    def params(self) -> SamplingParams:
        """The latest request's params."""
        return self.requests[-1][1]

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        self.requests.append((prompt, params))
        rid = request_id or "r"
        if self.refusal is not None:
            yield OutputDelta.failed(rid, self.refusal, ErrorKind.INVALID)
            return
        if self.pieces:
            for i, piece in enumerate(self.pieces):
                last = i == len(self.pieces) - 1
                yield OutputDelta(
                    request_id=rid,
                    text=piece,
                    token_ids=(1,),
                    finish_reason="stop" if last else None,
                    stop_reason=None,
                    num_prompt_tokens=1,
                    num_output_tokens=i + 1,
                    error=None,
                    logprobs=None,
                    index=0,
                )
            return
        for index in range(params.n):
            yield OutputDelta(
                request_id=rid,
                text=self.reply,
                token_ids=(1,),
                finish_reason="stop",
                stop_reason=None,
                num_prompt_tokens=1,
                num_output_tokens=1,
                error=None,
                logprobs=None if params.logprobs is None else (self._row(params.logprobs),),
                index=index,
            )

    def _row(self, k: int) -> tuple[TokenLogprob, ...]:
        chosen = TokenLogprob(1, -0.5, 2, self.reply)
        top = [TokenLogprob(t, -0.1 * t, t, f"t{t}") for t in range(1, k + 1)]
        return (chosen, *top)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> EngineStats:
        """An idle engine's (nothing here runs on it)."""
        return EngineStats(
            num_blocks=self.ready.num_blocks,
            num_used_blocks=0,
            num_free_blocks=self.ready.num_blocks,
            kv_slot_utilization=0.0,
            mean_kv_slot_utilization=0.0,
            num_preemptions=0,
            num_steps=0,
            num_running=0,
            num_waiting=0,
        )

    def watch_stats(self) -> WatchStats:
        return WatchStats(0, 0, 0.0, 0.0)

    def replica_statuses(self) -> tuple[EngineStatus, ...]:
        return (self.status,)

    def replica_stats(self) -> tuple:
        return ()

    async def shutdown(self, timeout: float = 10.0) -> None:
        pass


def recording_app(engine: RecordingEngine, config: ServerConfig | None = None) -> Starlette:
    """The server's app (every route, its middleware) around `engine`."""
    config = config or ServerConfig(model_name=MODEL)
    return build_app(config, server=Server(engine, config))
