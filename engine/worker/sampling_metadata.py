"""One step's sampling parameters as batched tensors, built once per step for the sampler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from engine.worker.grammar.step_bitmask import GrammarBitmask

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one sequence this step.

    `stop_ids_for_min_tokens`: the engine fills it with the eos ids (unless ignore_eos)
    plus `params.stop_token_ids`; these are masked while len(output) < min_tokens.
    `sample_index` tells apart the n sequences of one seeded request (0 for the first),
    so they draw different noise from the same seed.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_ids_for_min_tokens: frozenset[int] = frozenset()
    sample_index: int = 0


def step_seed(seed: int, num_output_tokens: int, sample_index: int = 0) -> int:
    """A 63-bit generator seed derived statelessly from the request seed and position.

    Same inputs, same seed: a seeded sequence draws the same noise whether it runs alone,
    in any batch, or again after preemption.
    """
    x = (seed & _MASK64) ^ ((num_output_tokens * 0x9E3779B97F4A7C15) & _MASK64)
    x = (x + sample_index * 0xD1B54A32D192ED03) & _MASK64
    for _ in range(2):  # splitmix64 finalizer, twice for good measure
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


@dataclass
class SamplingMetadata:
    """Batched sampling state for B rows; the sampler reads it and never changes it.

    Contract: row i of every tensor belongs to `rows[i]` given to `from_rows`. Greedy rows
    carry temperature 1.0 (never divided by zero). `top_k` is in [1, V] (V = disabled).
    The `any_*` flags are False when the stage would be a no-op for every row, so the
    sampler can skip it without reading tensors. Penalty tensors are None unless
    `any_penalties`. Sparse index tensors are 1-D and of equal length. `grammar`: the
    structured-outputs mask of the constrained rows (None: no row is constrained).
    """

    vocab_size: int
    temperature: Tensor  # [B] float32
    greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    min_p: Tensor  # [B] float32
    repetition_penalty: Tensor  # [B] float32
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    all_greedy: bool
    all_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    output_counts: Tensor | None = None  # [B, V] int32: count of each token in the output
    prompt_mask: Tensor | None = None  # [B, V] bool: token occurs in the prompt
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None  # [M] row, [M] token, [M] value
    min_tokens_mask: tuple[Tensor, Tensor] | None = None  # [M] row, [M] token
    seeded_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, step seed)
    max_num_logprobs: int = 0
    logprobs_rows: list[int | None] = field(default_factory=list)
    grammar: GrammarBitmask | None = None

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def any_logprobs(self) -> bool:
        return any(n is not None for n in self.logprobs_rows)

    @classmethod
    def from_rows(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        grammar: GrammarBitmask | None = None,
        table: Tensor | None = None,
        penalties: Callable[[list[bool]], tuple[Tensor, Tensor]] | None = None,
    ) -> SamplingMetadata:
        """Build every tensor of the step at once (a few host-to-device copies).
        `table`: the rows' `param_columns` already on the device ([B, 8] float32, e.g.
        gathered from per-request state kept there), instead of built here;
        `penalties`: given which rows are penalized, their output counts and prompt
        masks from state kept on the device, instead of built here."""
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]
        random = [not g for g in greedy]
        top_k = [_top_k(p, vocab_size) for p in params]
        penalized = [has_penalty(p) for p in params]
        logprobs_rows = [p.logprobs for p in params]
        if table is None:
            column = _columns(params, greedy, top_k, device)
        else:
            column = dict(zip(COLUMNS, table.t().contiguous(), strict=True))  # each [B]
            column.update(greedy=column["greedy"].bool(), top_k=column["top_k"].long())
        md = cls(
            vocab_size=vocab_size,
            **column,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            any_top_k=any(r and k < vocab_size for r, k in zip(random, top_k, strict=True)),
            any_top_p=any(r and p.top_p < 1.0 for r, p in zip(random, params, strict=True)),
            any_min_p=any(r and p.min_p > 0.0 for r, p in zip(random, params, strict=True)),
            any_penalties=any(penalized),
            logit_bias=_logit_bias(rows, vocab_size, device),
            min_tokens_mask=_min_tokens_mask(rows, vocab_size, device),
            seeded_rows=_seeded_rows(rows),
            max_num_logprobs=max((n for n in logprobs_rows if n is not None), default=0),
            logprobs_rows=logprobs_rows,
            grammar=grammar,
        )
        if md.any_penalties:
            if penalties is not None:
                md.output_counts, md.prompt_mask = penalties(penalized)
            else:
                md.output_counts, md.prompt_mask = _penalty_tensors(
                    rows, penalized, vocab_size, device
                )
        return md


COLUMNS = (
    "temperature",
    "greedy",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def param_columns(p: SamplingParams, vocab_size: int) -> list[float]:
    """A row's per-row sampling parameters, in COLUMNS order (greedy rows carry
    temperature 1.0; top_k in [1, V]; every value exact in float32)."""
    return [
        _temperature(p),
        float(p.is_greedy),
        float(_top_k(p, vocab_size)),
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    ]


def _columns(params, greedy, top_k, device) -> dict[str, Tensor]:
    """The per-row parameter tensors, each [B], built from the rows (host path)."""

    def floats(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)  # [B]

    return dict(
        temperature=floats([_temperature(p) for p in params]),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=floats([p.top_p for p in params]),
        min_p=floats([p.min_p for p in params]),
        repetition_penalty=floats([p.repetition_penalty for p in params]),
        presence_penalty=floats([p.presence_penalty for p in params]),
        frequency_penalty=floats([p.frequency_penalty for p in params]),
    )


def _temperature(p: SamplingParams) -> float:
    return 1.0 if p.is_greedy else p.temperature  # greedy rows are never divided by 0


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    return p.top_k if 0 < p.top_k < vocab_size else vocab_size


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _logit_bias(
    rows: list[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor] | None:
    row_idx: list[int] = []
    token_idx: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"logit_bias must be keyed by token ids < vocab size {vocab_size}, "
                    f"got {token_id}"
                )
            row_idx.append(i)
            token_idx.append(token_id)
            values.append(bias)
    if not row_idx:
        return None
    return (
        torch.tensor(row_idx, dtype=torch.int64, device=device),  # [M]
        torch.tensor(token_idx, dtype=torch.int64, device=device),  # [M]
        torch.tensor(values, dtype=torch.float32, device=device),  # [M]
    )


def _min_tokens_mask(
    rows: list[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[Tensor, Tensor] | None:
    """Stop ids of rows still short of min_tokens; ids the model cannot emit are dropped."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        for token_id in row.stop_ids_for_min_tokens:
            if 0 <= token_id < vocab_size:
                row_idx.append(i)
                token_idx.append(token_id)
    if not row_idx:
        return None
    return (
        torch.tensor(row_idx, dtype=torch.int64, device=device),  # [M]
        torch.tensor(token_idx, dtype=torch.int64, device=device),  # [M]
    )


def _seeded_rows(rows: list[SamplingRow]) -> list[tuple[int, int]]:
    return [
        (i, step_seed(row.params.seed, len(row.output_token_ids), row.sample_index))
        for i, row in enumerate(rows)
        if row.params.seed is not None and not row.params.is_greedy
    ]


def _padded(
    seqs: list[Sequence[int]], pad: int, device: torch.device | str
) -> Tensor:  # [B, L] int64
    width = max((len(s) for s in seqs), default=0)
    padded = [list(s) + [pad] * (width - len(s)) for s in seqs]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(seqs), width)


def _penalty_tensors(
    rows: list[SamplingRow], penalized: list[bool], vocab_size: int, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Output-token counts and prompt presence; rows without penalties stay all-zero."""
    pad = vocab_size  # an extra column that is dropped at the end
    chosen = [
        (r.output_token_ids, r.prompt_token_ids) if p else ((), ())
        for r, p in zip(rows, penalized, strict=True)
    ]
    outputs = _padded([out for out, _ in chosen], pad, device)  # [B, L_out]
    prompts = _padded([prompt for _, prompt in chosen], pad, device)  # [B, L_prompt]
    batch = len(rows)
    counts = torch.zeros((batch, vocab_size + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.int32))
    prompt_mask = torch.zeros((batch, vocab_size + 1), dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompts, True)
    return counts[:, :vocab_size], prompt_mask[:, :vocab_size]  # [B, V], [B, V]
