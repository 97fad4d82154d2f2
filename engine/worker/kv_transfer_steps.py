"""`KVTransferSteps`: a worker's share of prefill/decode disaggregation, per step.

- Producer (`kv_transfer_params.do_remote_decode`): once a step has computed a row's
  whole prompt, the blocks holding it are saved with the final hidden state at the
  prompt's last position (copied out of the cache and held for a decode instance to
  fetch) before anything can reuse them.
- Consumer (`do_remote_prefill`): a plan's `load_ids` start fetching those requests'
  prompts into their blocks, in the background, while steps of other requests run
  (the connector writes each load's blocks as they arrive: they are the loading
  request's alone); each step's `poll` reports the loads that ended and those that
  failed or outlasted the connector's fetch timeout (they fail their request, never
  a step). A loaded
  request's first step computes nothing: its last prompt token's KV came with the
  others and its first output token is sampled from the hidden state sent beside
  them (vLLM computes that token again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.kv_transfer.connector import KVConnector
from engine.worker.worker_request import WorkerRequest

IDLE_WAIT_S = 0.01  # with no step to run, how long a poll waits for a load to end


class KVTransferSteps:
    """Saves and loads through `connector` for requests of `block_size`-token blocks."""

    def __init__(self, connector: KVConnector, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self._pending: dict[str, WorkerRequest] = {}  # loads started, not ended

    def prompt_blocks(self, request: WorkerRequest, table: Sequence[int]) -> list[int]:
        """The blocks of `table` that hold `request`'s prompt."""
        return list(table[: -(-request.num_prompt_tokens // self.block_size)])

    def start(self, request: WorkerRequest, table: Sequence[int]) -> None:
        """Starts fetching `request`'s prompt into the blocks of `table` holding it."""
        params = request.params.kv_transfer_params
        self._pending[request.request_id] = request
        self.connector.start_load(request.request_id, params, self.prompt_blocks(request, table))

    def poll(self, wait: bool = False) -> tuple[list[str], dict[str, str]]:
        """The loads that ended since the last call: the ids whose KV is in the cache
        (each request's `remote_hidden` set), and {id: error} of those that failed.
        `wait`: with loads pending and none ended, first wait up to IDLE_WAIT_S."""
        if wait and self._pending:
            self.connector.wait(IDLE_WAIT_S)
        loaded, errors = [], {}
        for result in self.connector.poll():
            request = self._pending.pop(result.request_id, None)
            if request is None:
                continue  # cancelled (its request ended) before its KV arrived
            if result.ok:
                request.remote_hidden = result.hidden
                loaded.append(result.request_id)
            else:
                errors[result.request_id] = f"loading its KV cache failed: {result.error}"
        return loaded, errors

    def save(
        self, rows: Iterable[tuple[WorkerRequest, Sequence[int]]], hidden: Mapping[str, Any]
    ) -> None:
        """Saves the prompts this step completed: rows of (request, table), with their
        last positions' hidden states `hidden` (by request id, as the step gave them)."""
        for request, table in rows:
            last_hidden = hidden.get(request.request_id)
            if last_hidden is not None:
                blocks = self.prompt_blocks(request, table)
                self.connector.save_request(request.request_id, blocks, last_hidden)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Ended requests: a load still on its way is cancelled (what arrives for it is
        never written: its blocks may already be another request's)."""
        for request_id in request_ids:
            if self._pending.pop(request_id, None) is not None:
                self.connector.cancel(request_id)

    def close(self) -> None:
        self.connector.close()
