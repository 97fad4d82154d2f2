"""What one model step produced, as plain values (the worker reads it; the one tensor
field, `prompt_hidden`, it only hands on to KV transfer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import Logprob

LogprobDict = dict[int, Logprob]  # one position's row: the chosen token first, then the top


@dataclass(frozen=True)
class Verified:
    """A row's draft tokens after verification: how many it verified, the leading ones
    accepted, and their logprob rows (empty unless its request asked for logprobs)."""

    num_drafts: int
    accepted: list[int]
    logprobs: list[LogprobDict] = field(default_factory=list)


@dataclass(frozen=True)
class ModelOutput:
    """One step's results by request id: the sampled token of each row that sampled;
    for those whose request asked for logprobs, the sampled token's row (that token
    first, with its true rank, then the request's own top `params.logprobs`); and for
    requests asking for prompt logprobs, one row per prompt position scored in this
    step (each next prompt token first, then the top `params.prompt_logprobs`).
    `verified`: the rows that verified drafts; a row's accepted drafts come before its
    sampled token (the token drawn where verification stopped). `prompt_hidden`: the
    final hidden state at the prompt's last position ([hidden_size] tensors) of the rows
    that completed a prompt for a decode instance."""

    sampled: dict[str, int]
    logprobs: dict[str, LogprobDict] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobDict]] = field(default_factory=dict)
    verified: dict[str, Verified] = field(default_factory=dict)
    prompt_hidden: dict[str, Any] = field(default_factory=dict)
