"""Turn one step's logits into token ids: logits processing, then greedy or random draws."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.worker.logprobs import TokenLogprobs, compute_token_logprobs
from engine.worker.sampling_metadata import SamplingMetadata

_MIN_NOISE = 1e-20  # keeps the exponential race finite if a draw is exactly 0


@dataclass
class SamplerOutput:
    """The step's sampled tokens and, when any row asked, their logprobs.

    `logprobs` comes from the RAW logits (before bias, penalties, temperature, ...) with
    K = `SamplingMetadata.max_num_logprobs`; rows cut it to their own count.
    """

    sampled_token_ids: Tensor  # [B] int64
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Samples one token per row of a [B, V] logits tensor, vectorized over the batch.

    Order: logit_bias, min_tokens mask, repetition penalty, presence/frequency
    penalties, the grammar mask (structured outputs: tokens it forbids go to -inf);
    greedy rows take the argmax of that; random rows then divide by temperature, apply
    top-k, top-p and min-p, and draw with the exponential race
    argmax(probs / q), q ~ Exp(1). Unseeded rows draw q from `generator` (torch's global
    RNG when None; it must live on the logits' device); seeded rows draw q from a fresh
    generator seeded with their stateless per-step seed. The input logits are not changed.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V] any float dtype
        if logits.dim() != 2 or logits.shape[0] != md.batch_size:
            raise ValueError(
                f"logits must be [batch={md.batch_size}, vocab], got {tuple(logits.shape)}"
            )
        x = self.process_logits(logits, md)  # [B, V] float32
        if md.all_greedy:
            tokens = x.argmax(dim=-1)
        elif md.all_random:
            tokens = self._sample_random(x, md)
        else:
            greedy_tokens = x.argmax(dim=-1)
            tokens = torch.where(md.greedy, greedy_tokens, self._sample_random(x, md))
        tokens = tokens.to(torch.int64)  # [B]
        logprobs = None
        if md.any_logprobs:
            logprobs = compute_token_logprobs(logits, tokens, md.max_num_logprobs)
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def process_logits(logits: Tensor, md: SamplingMetadata) -> Tensor:
        """Bias, min_tokens mask, penalties and the grammar mask on a float32 copy:
        [B, V] -> [B, V]."""
        x = logits.to(torch.float32, copy=True)  # [B, V]
        if md.logit_bias is not None:
            rows, tokens, values = md.logit_bias
            x.index_put_((rows, tokens), values, accumulate=True)
        if md.min_tokens_mask is not None:
            rows, tokens = md.min_tokens_mask
            x.index_put_((rows, tokens), x.new_tensor(float("-inf")))
        if md.any_penalties:
            x = _apply_penalties(x, md)
        if md.grammar is not None:
            md.grammar.apply(x)
        return x

    def _sample_random(self, x: Tensor, md: SamplingMetadata) -> Tensor:
        """Temperature, top-k/top-p/min-p, then one exponential race per row: [B, V] -> [B]."""
        probs = _filtered_probs(x, md)  # [B, V]
        noise = self._exponential_noise(probs, md)  # [B, V]
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def probabilities(x: Tensor, md: SamplingMetadata) -> Tensor:
        """The distribution a random row draws from, given its processed logits
        (`process_logits`): temperature, top-k/top-p/min-p, normalized. [B, V] -> [B, V]."""
        probs = _filtered_probs(x, md)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _exponential_noise(self, probs: Tensor, md: SamplingMetadata) -> Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)  # [B, V]
        for row, seed in md.seeded_rows:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
        return noise.clamp_min_(_MIN_NOISE)


def _filtered_probs(x: Tensor, md: SamplingMetadata) -> Tensor:
    """Temperature, top-k/top-p, softmax, then min-p's cut (not renormalized): [B, V]."""
    x = x / md.temperature.unsqueeze(1)  # [B, V]
    if md.any_top_k or md.any_top_p:
        x = _top_k_top_p(x, md)
    probs = torch.softmax(x, dim=-1)  # [B, V]
    if md.any_min_p:
        max_p = probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = probs.masked_fill(probs < md.min_p.unsqueeze(1) * max_p, 0.0)
    return probs


def _apply_penalties(x: Tensor, md: SamplingMetadata) -> Tensor:
    """HF repetition penalty over prompt+output, then OpenAI presence/frequency over output."""
    assert md.output_counts is not None and md.prompt_mask is not None
    counts = md.output_counts.to(torch.float32)  # [B, V]
    seen_in_output = md.output_counts > 0  # [B, V]
    seen = md.prompt_mask | seen_in_output  # [B, V]
    penalty = md.repetition_penalty.unsqueeze(1)  # [B, 1]
    penalized = torch.where(x > 0, x / penalty, x * penalty)
    x = torch.where(seen, penalized, x)
    x = x - md.frequency_penalty.unsqueeze(1) * counts
    return x - md.presence_penalty.unsqueeze(1) * seen_in_output.to(torch.float32)


def _top_k_top_p(x: Tensor, md: SamplingMetadata) -> Tensor:
    """Mask all but each row's top-k tokens, then all but its top-p mass; one sort.

    Ties at the k-th value are all kept; the most likely token always survives.
    """
    sorted_x, order = x.sort(dim=-1, descending=False)  # [B, V] ascending
    vocab = x.shape[1]
    if md.any_top_k:
        kth = sorted_x.gather(1, (vocab - md.top_k).unsqueeze(1))  # [B, 1]
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if md.any_top_p:
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)  # [B, V]
        drop = cum <= (1.0 - md.top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)  # [B, V] back in vocab order
