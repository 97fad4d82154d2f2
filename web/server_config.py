"""What `pagedserve serve` is configured with (frozen once built)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.async_engine import Supervision
from actors.replica_launch import check_num_replicas
from actors.restarting_engine import RestartPolicy
from web.api_keys import ApiKeys
from web.chat_parsing import ChatParsing


@dataclass(frozen=True)
class ServerConfig:
    """Server-side settings; the engine's own live in EngineArgs.

    `model_name` is what /v1/models lists and responses echo; `builtin` marks the
    built-in random-weight model (the chat page says so)."""

    model_name: str
    builtin: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    max_queued_requests: int = 256
    max_requests_per_connection: int = 64
    max_message_bytes: int = 1 << 20  # WebSocket frames and HTTP bodies
    default_max_tokens: int = 256
    session_ttl_s: float = 1800.0
    session_max_chars: int = 32_000
    pipeline_depth: int = 2
    shutdown_grace_s: float = 5.0  # in-flight requests' time to finish on SIGINT/SIGTERM
    supervision: Supervision = field(default_factory=Supervision)  # worker and request timeouts
    ws_auth_timeout_s: float = 5.0  # a WebSocket not authenticated by then is closed
    disable_log_stats: bool = False  # no periodic throughput / queue / KV usage line
    log_stats_interval_s: float = 5.0  # seconds between those lines (when something happened)
    data_parallel_size: int = 1  # engine replicas behind this server (actors/replica_set.py)
    # generation requests one client (API key, else address) may have open at once
    max_concurrent_per_key: int | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # a dead worker comes back
    chat_parsing: ChatParsing = field(default_factory=ChatParsing)  # tool calls, reasoning

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_requests_per_connection", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ValueError(f"shutdown_grace_s must be in [0, 3600], got {self.shutdown_grace_s}")
        if not self.ws_auth_timeout_s > 0:
            raise ValueError(f"ws_auth_timeout_s must be > 0, got {self.ws_auth_timeout_s}")
        if not 0 < self.log_stats_interval_s < float("inf"):
            raise ValueError(
                f"log_stats_interval_s must be a positive number of seconds, "
                f"got {self.log_stats_interval_s}"
            )
        check_num_replicas(self.data_parallel_size)
        cap = self.max_concurrent_per_key
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_concurrent_per_key must be an int >= 1 or None, got {cap!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
