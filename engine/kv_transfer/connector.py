"""The KV connector: the one seam between an engine and however KV blocks travel.

vLLM's shape, narrowed to what a prefill/decode pair needs. One object per worker
(each tensor-parallel rank moves its own heads), built over that worker's KV cache; its
`kv_role` says which half it does (`KVRole.BOTH`: both).

Producer half (the prefill instance):
  1. `save_request(request_id, block_ids, hidden)` once the request's prompt is in its
     blocks (after the step that computed it): the blocks, and `hidden` (the final
     hidden state at the prompt's last position), are copied out and held for a
     consumer, so the scheduler may free or reuse them at once.
  2. `request_finished(request_id, block_ids)` -> the `KVTransferParams` to hand back in
     the response (where the blocks are held, under which ids).
Held blocks go once fetched, or after `hold_timeout_s`, or, oldest first, when
`kv_buffer_size` bytes would be exceeded.

Consumer half (the decode instance):
  1. `start_load(request_id, params, local_block_ids)` once blocks are allocated for the
     request: returns at once, the fetch goes on in the background. With fewer local
     blocks than remote ones, the last `len(local_block_ids)` remote blocks are loaded
     (the front is in the local prefix cache).
  2. `poll()` between steps: one `LoadResult` per load that ended since the last
     call, ok (its blocks written into the cache, with the producer's hidden state) or
     failed with the reason. A load's blocks are written as they arrive, by the
     connector, while steps run: they belong to the loading request alone. A load ends
     within `fetch_timeout_s`, whatever the producer does. The scheduler runs a
     request only after its load is ok, and recomputes its prompt (or fails it) if not.

  3. `wait(timeout_s)`: blocks until a load has ended (for a caller with nothing else
     to do), or the timeout passes.
  4. `cancel(request_id)`: the request ended: whatever arrives for it is never written
     (its blocks may belong to another request by then) and its load never ends.

`close()` stops the transfers: loads in flight end failed at the next `poll()`.
Methods of the other half raise RuntimeError naming the role.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.kv_transfer.config import KVRole
from engine.kv_transfer.params import KVTransferParams


class KVTransferError(RuntimeError):
    """A transfer that cannot be done; the message says why and, where it can, what to do."""


@dataclass(frozen=True)
class LoadResult:
    """How one load ended: `error` None if the request's blocks are in the cache;
    `hidden` then holds the prompt's last hidden state (a `[hidden_size]` tensor on the
    cache's device), from which its first token is sampled."""

    request_id: str
    error: str | None = None
    hidden: Any = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None


class KVConnector(Protocol):
    """Saves finished prompts' blocks for another instance, or loads them from one (see
    the module doc for the call order and its guarantees)."""

    @property
    def role(self) -> KVRole: ...

    def save_request(self, request_id: str, block_ids: Sequence[int], hidden: Any) -> None: ...

    def request_finished(self, request_id: str, block_ids: Sequence[int]) -> KVTransferParams: ...

    def start_load(
        self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int]
    ) -> None: ...

    def poll(self) -> list[LoadResult]: ...

    def wait(self, timeout_s: float) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def close(self) -> None: ...


def require_role(role: KVRole, producer: bool, what: str) -> None:
    """RuntimeError unless `role` does the producer (or consumer) half."""
    if role.produces if producer else role.consumes:
        return
    half = "kv_producer or kv_both" if producer else "kv_consumer or kv_both"
    raise RuntimeError(f"{what} needs kv_role {half}; this instance is {role.value}")
