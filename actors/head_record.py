"""What a head and its remote ranks agree on: the store's keys, the authenticated
channels' names, and the JoinRecord (`actors.head` has the whole exchange). No torch:
`pagedserve worker --help` and the CLI import it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

RUN_KEY = "pagedserve/run"
JOIN_KEY = "pagedserve/join"


def claim_key(rank: int) -> str:
    return f"pagedserve/claim/{rank}"


def rank_key(rank: int) -> str:
    return f"pagedserve/rank/{rank}"


def channel(run_id: str, name: str) -> str:
    """An authenticated channel's name in run `run_id`: `join`, `rank-R`, `plan-R`,
    `heartbeat-R`."""
    return f"{run_id}/{name}"


@dataclass(frozen=True)
class JoinRecord:
    """What the head tells every remote rank: the engine arguments (the rendezvous set
    in them), the first remote rank, and where each remote rank sends its heartbeats
    (`heartbeat_addresses[i]`: rank `first_remote_rank + i`'s)."""

    engine_args: dict
    first_remote_rank: int
    heartbeat_addresses: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.first_remote_rank + len(self.heartbeat_addresses)

    def heartbeat_address(self, rank: int) -> str:
        return self.heartbeat_addresses[rank - self.first_remote_rank]

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> JoinRecord:
        fields = json.loads(data)
        return cls(
            fields["engine_args"],
            int(fields["first_remote_rank"]),
            tuple(fields["heartbeat_addresses"]),
        )
