"""One worker's end of KV transfer: what every connector does with the cache, whatever
carries the bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from engine.kv_transfer.blocks import (
    TOKEN_MAJOR,
    KVCache,
    KVLayout,
    gather_blocks,
    hidden_of,
    scatter_blocks,
    with_hidden,
)
from engine.kv_transfer.config import KVRole, KVTransferConfig
from engine.kv_transfer.connector import LoadResult, require_role
from engine.kv_transfer.held_blocks import HeldBlocks
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.payload import KVPayload


class KVEndpoint:
    """The cache a connector saves from and loads into (tensors in `layout`), the blocks
    it holds for consumers (`held`), and its loads in flight.

    A connector calls `save` and `params` for the producer half; for the consumer half,
    `begin_load` (which remote blocks to fetch), then `arrived` (which writes the blocks,
    in its caller's thread) or `failed` when the transfer ends (from any thread), and
    `poll` returns what ended. Each load ends exactly once; a cancelled one (`cancel`)
    never ends, and nothing of it is written after `cancel` returns."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache: KVCache,
        layout: KVLayout = TOKEN_MAJOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.layout = layout
        self.held = HeldBlocks(config.kv_buffer_size, config.hold_timeout_s, clock)
        self._loading: dict[str, tuple[int, ...]] = {}  # request id -> local block ids
        # (request id, its hidden state, error) of the loads that ended since `poll`
        self._ended: list[tuple[str, torch.Tensor | None, str | None]] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # held while a payload is written; cancel waits
        self._any_ended = threading.Event()  # set while `_ended` holds something

    @property
    def role(self) -> KVRole:
        return self.config.kv_role

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def save(self, request_id: str, block_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """Holds the blocks `block_ids` of `request_id` with its prompt's last hidden
        state `hidden` ([hidden_size])."""
        require_role(self.role, True, "save_request")
        payload = gather_blocks(self.kv_cache, block_ids, self.layout)
        self.held.put(request_id, block_ids, with_hidden(payload, hidden))

    def params(self, request_id: str, block_ids: Sequence[int], port: int) -> KVTransferParams:
        """Where the blocks `block_ids` of `request_id` are held (served on `port`)."""
        require_role(self.role, True, "request_finished")
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_block_ids=tuple(block_ids),
            remote_host=self.config.kv_ip,
            remote_port=port,
            remote_request_id=request_id,
        )

    def begin_load(
        self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int]
    ) -> tuple[int, ...] | None:
        """The remote block ids to fetch into `local_block_ids` (the last ones, when the
        front is cached here), or None when the load has already failed (`params` do not
        describe a load that fits)."""
        require_role(self.role, False, "start_load")
        with self._lock:
            if request_id in self._loading:
                raise ValueError(f"a load for request {request_id!r} is already in flight")
            self._loading[request_id] = tuple(local_block_ids)
        remote = params.remote_block_ids or ()
        if not params.do_remote_prefill:
            self.failed(request_id, "its kv_transfer_params do not say do_remote_prefill")
            return None
        if len(local_block_ids) > len(remote):
            self.failed(
                request_id,
                f"{len(local_block_ids)} blocks were allocated for it here but the producer "
                f"saved {len(remote)}; both instances must run the same block_size",
            )
            return None
        return remote[len(remote) - len(local_block_ids) :]

    def arrived(self, request_id: str, payload: KVPayload) -> None:
        """Writes the payload into the load's blocks, in the caller's thread (the
        connector's: the worker's steps go on meanwhile; the blocks are the loading
        request's alone), unless the load was cancelled; `poll` reports it."""
        with self._write_lock:
            local = self._loading.get(request_id)
            if local is None:
                return  # cancelled, or ended already
            hidden, error = None, None
            try:
                scatter_blocks(self.kv_cache, local, payload, self.layout)
                hidden = self._hidden(payload)
            except ValueError as exc:
                error = str(exc)
        with self._lock:
            self._ended.append((request_id, hidden, error))
            self._any_ended.set()

    def failed(self, request_id: str, error: str) -> None:
        with self._lock:
            self._ended.append((request_id, None, error))
            self._any_ended.set()

    def wait(self, timeout_s: float) -> bool:
        """Blocks until a load has ended since the last `poll` (True), or `timeout_s`."""
        return self._any_ended.wait(timeout_s)

    def cancel(self, request_id: str) -> None:
        """Forgets `request_id`'s load: whatever arrives for it is never written (a
        write in progress finishes first: its blocks may be someone else's next)."""
        with self._write_lock, self._lock:
            self._loading.pop(request_id, None)

    def poll(self) -> list[LoadResult]:
        """The loads that ended since the last call; those that arrived are in the cache."""
        with self._lock:
            ended, self._ended = self._ended, []
            self._any_ended.clear()
            results = []
            for request_id, hidden, error in ended:
                if self._loading.pop(request_id, None) is None:
                    continue  # ended twice (a late answer after a failure): once counts
                results.append(LoadResult(request_id, error, hidden))
        self.held.expire()
        return results

    def _hidden(self, payload: KVPayload) -> torch.Tensor:
        """The payload's hidden state on the cache's device; ValueError if it has none."""
        hidden = hidden_of(payload, self.kv_cache[0][0].device)
        if hidden is None:
            raise ValueError(
                "the producer sent no hidden state for the prompt's last position (both "
                "instances must run the same pagedserve version)"
            )
        return hidden

    def fail_all(self, error: str) -> None:
        """Ends every load in flight with `error` (the connector is closing)."""
        for request_id in list(self._loading):
            self.failed(request_id, error)
