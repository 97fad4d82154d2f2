"""What an engine client's /health says: one engine's status, and a data-parallel set's
status combined from its replicas'."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class EngineStatus(StrEnum):
    """An engine client's state. OK and DEGRADED serve requests (HTTP 200); RESTARTING
    and UNHEALTHY do not (503)."""

    OK = "ok"
    DEGRADED = "degraded"  # some data-parallel replicas serve, the others do not
    RESTARTING = "restarting"  # a dead worker is being replaced
    UNHEALTHY = "unhealthy"  # stalled, or down for good

    @property
    def serves(self) -> bool:
        return self in (EngineStatus.OK, EngineStatus.DEGRADED)

    @classmethod
    def of_replicas(cls, statuses: Sequence[EngineStatus]) -> EngineStatus:
        """OK when every replica serves fully, DEGRADED when some serve, else
        RESTARTING if one is coming back, else UNHEALTHY."""
        serving = [s.serves for s in statuses]
        if all(s is cls.OK for s in statuses):
            return cls.OK
        if any(serving):
            return cls.DEGRADED
        return cls.RESTARTING if cls.RESTARTING in statuses else cls.UNHEALTHY
