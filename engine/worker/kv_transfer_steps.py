"""`KVTransferSteps`: a worker's share of prefill/decode disaggregation, per step.

- Producer (`kv_transfer_params.do_remote_decode`): once a step has computed a row's
  whole prompt, the blocks holding it are saved with the final hidden state at the
  prompt's last position (copied out of the cache and held for a decode instance to
  fetch) before anything can reuse them.
- Consumer (`do_remote_prefill`): before the first step that runs such a request (the
  scheduler counted all but its last prompt token as computed), the prompt's blocks
  are loaded into the request's own blocks, the last token's KV among them, and the
  step samples the first token from the hidden state that came with them: no prompt
  position is computed here (vLLM computes the last one again). A load that fails or
  outlasts the connector's fetch timeout fails its request, never the step.

Loads run before the step, synchronously: the step waits for its transfers (vLLM
overlaps them with other requests' steps).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.kv_transfer.connector import KVConnector
from engine.worker.worker_request import WorkerRequest

POLL_INTERVAL_S = 0.001
LOAD_LIMIT_S = 30.0  # past the connector's own timeouts: a guard, never reached


class KVTransferSteps:
    """Saves and loads through `connector` for requests of `block_size`-token blocks."""

    def __init__(self, connector: KVConnector, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self._loaded: set[str] = set()  # consumer requests whose prompt KV arrived

    def prompt_blocks(self, request: WorkerRequest, table: Sequence[int]) -> list[int]:
        """The blocks of `table` that hold `request`'s prompt."""
        return list(table[: -(-request.num_prompt_tokens // self.block_size)])

    def load(self, rows: Iterable[tuple[WorkerRequest, Sequence[int]]]) -> dict[str, str]:
        """Loads the prompts of the rows that wait for theirs; {request id: error} of
        those that failed."""
        pending = {}
        for request, table in rows:
            params = request.params.kv_transfer_params
            if params is None or not params.do_remote_prefill:
                continue
            if request.request_id in self._loaded or request.num_computed_tokens == 0:
                continue  # loaded already, or recomputing after a preemption
            blocks = self.prompt_blocks(request, table)
            self.connector.start_load(request.request_id, params, blocks)
            pending[request.request_id] = request
        errors: dict[str, str] = {}
        deadline = time.monotonic() + LOAD_LIMIT_S
        while pending and time.monotonic() < deadline:
            for result in self.connector.poll():
                request = pending.pop(result.request_id, None)
                if request is None:
                    continue
                if result.ok:
                    self._loaded.add(result.request_id)
                    request.remote_hidden = result.hidden
                else:
                    errors[result.request_id] = f"loading its KV cache failed: {result.error}"
            if pending:
                time.sleep(POLL_INTERVAL_S)
        for request_id in pending:
            errors[request_id] = "loading its KV cache did not finish"
        return errors

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
        """Finished requests: nothing more to load for them."""
        self._loaded.difference_update(request_ids)

    def close(self) -> None:
        self.connector.close()
