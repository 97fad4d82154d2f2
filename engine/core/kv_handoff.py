"""Prefill/decode disaggregation in the engine core: which prompt tokens a decode
instance loads instead of computing, and what a prefill instance answers.

A request with `kv_transfer_params.do_remote_prefill` starts with all but its prompt's
last token counted as computed (`remote_tokens`): its worker loads the prompt's KV
before the request's first step, which schedules the last token but computes nothing:
its KV came with the others and its logits come from the final hidden state the
prefill instance sent beside them (vLLM computes that token again). A
request with `do_remote_decode` ends with `handoff`: where its prompt's blocks wait (its
worker saved them once the prompt was computed), for the proxy to pass on.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_transfer.config import KVTransferConfig
from engine.kv_transfer.params import KVTransferParams
from engine.sampling_params import SamplingParams


def remote_tokens(params: SamplingParams, num_prompt_tokens: int) -> int:
    """Prompt tokens whose KV a prefill instance computed for this request (0: none)."""
    transfer = params.kv_transfer_params
    if transfer is None or not transfer.do_remote_prefill:
        return 0
    return num_prompt_tokens - 1


def handoff(
    params: SamplingParams,
    request_id: str,
    prompt_blocks: Sequence[int],
    config: KVTransferConfig | None,
) -> KVTransferParams | None:
    """A producer's answer to `do_remote_decode` (None for any other request): the
    request's prompt blocks `prompt_blocks`, held under its id at this instance."""
    transfer = params.kv_transfer_params
    if transfer is None or not transfer.do_remote_decode or config is None:
        return None
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=config.engine_id,
        remote_block_ids=tuple(prompt_blocks),
        remote_host=config.kv_ip,
        remote_port=config.kv_port,
        remote_request_id=request_id,
    )
