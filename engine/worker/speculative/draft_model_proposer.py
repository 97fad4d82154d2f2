"""Draft tokens from a smaller model (vLLM's `draft_model` method), with its own paged
KV cache in the same worker."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, DeviceConfig, ModelConfig
from engine.core.request import KnownTokens
from engine.core.scheduler_output import ScheduledRequest
from engine.sampling_params import SamplingParams
from engine.worker.attention.selector import select_backend
from engine.worker.input_batch import build_model_input
from engine.worker.kv_cache import KVCache, allocate_kv_cache, block_bytes
from engine.worker.model_loader import load_model
from engine.worker.worker_request import WorkerRequest

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Tokens(KnownTokens):
    """A sequence as a draft pass sees it: its known tokens and the drafts so far."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_scored_prompt_tokens: int  # all: a draft pass scores no prompt


class DraftModelProposer:
    """Proposes each row's drafts by decoding greedily with a draft model (one whose
    vocabulary is the target's) over the target's block tables: its KV cache has the
    target's block count and block size, so a sequence's table serves both, and a draft
    writes its KV in the slots its row reserved for drafts.

    Per sequence it remembers how many of the known tokens its cache holds
    (`WorkerRequest.num_draft_computed_tokens`; the worker resets it where the blocks'
    contents moved: preemption, swap, copy-on-write). A proposal first catches the
    cache up on the known tokens it lacks (a whole prompt the first time) and draws the
    first draft there, then runs k - 1 one-token passes; after verification the cache
    holds what was accepted (`after_step`). Greedy drafts are one-hot proposals, so the
    verifier stays exact in distribution for sampled rows.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache: CacheConfig,
        device: DeviceConfig,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache
        self.device = device.device
        choice = select_backend(
            device.attention_backend,
            self.device,
            model_config.dtype,
            model_config.attention_features,
            cache.block_size,
            None,
        )
        self.backend = choice.backend
        self.model = load_model(model_config, self.backend, self.device)
        self.kv_cache: KVCache = []
        logger.info(
            "draft model: %s (%s, %d layers)",
            model_config.model,
            model_config.architecture,
            model_config.num_layers,
        )

    def block_bytes(self) -> int:
        """The draft cache's bytes per block (the target's block count is sized with it)."""
        return block_bytes(self.model_config, self.cache_config.block_size)

    def initialize_cache(self, num_blocks: int) -> None:
        m = self.model_config
        bs = self.cache_config.block_size
        shape = self.backend.kv_cache_shape(num_blocks, bs, m.num_kv_heads, m.head_size)
        self.kv_cache = allocate_kv_cache(m, shape, self.device, False, m.dtype)

    @torch.inference_mode()
    def propose_batch(
        self,
        requests: Sequence[WorkerRequest],
        ks: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        """Up to ks[i] drafts for requests[i] (whose table is tables[i])."""
        views = [self._view(r) for r in requests]
        rows = []  # first pass: the known tokens its cache lacks (the last one at least)
        for view, r, table in zip(views, requests, tables, strict=True):
            done = r.num_draft_computed_tokens
            rows.append(ScheduledRequest(view, done, view.num_tokens - done, table))
        drafts: list[list[int]] = [[] for _ in requests]
        for step in range(max(ks)):
            live = [i for i, k in enumerate(ks) if k > step]
            tokens = self._forward([rows[i] for i in live])
            for i in live:
                token = tokens[requests[i].request_id]
                drafts[i].append(token)
                view = views[i]
                start = view.num_tokens
                view.output_token_ids.append(token)
                rows[i] = ScheduledRequest(view, start, 1, tables[i])
        for r, k in zip(requests, ks, strict=True):  # known tokens and the first k - 1 drafts
            r.num_draft_computed_tokens = r.num_tokens + k - 1
        return drafts

    def after_step(self, request: WorkerRequest) -> None:
        """The step's verification is in: the cache holds the known tokens it computed
        (its drafts past the first rejection were other tokens)."""
        request.num_draft_computed_tokens = min(
            request.num_draft_computed_tokens, request.num_computed_tokens
        )

    def _forward(self, rows: list[ScheduledRequest]) -> dict[str, int]:
        """One pass over `rows`: each row's greedy next token, by request id."""
        batch = build_model_input(rows, self.cache_config.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.metadata)
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [rows, vocab]
        ids = [r.request.request_id for r in batch.sample_rows]
        return dict(zip(ids, logits.argmax(dim=-1).tolist(), strict=True))

    @staticmethod
    def _view(r: WorkerRequest) -> _Tokens:
        return _Tokens(
            r.request_id,
            r.prompt_token_ids,
            list(r.output_token_ids),
            r.params,
            r.num_prompt_tokens,
        )
