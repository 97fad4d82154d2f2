"""The contract every model class fulfils, and the shared weight loading."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata


class CausalLM(nn.Module):
    """A decoder-only LM over a flattened batch and a paged KV cache.

    Subclasses name their parameters exactly as the Hugging Face checkpoint does, so
    `load_weights` copies tensors by name. Contract:
    - `forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden]`
      where `kv_caches[layer] = (key_cache, value_cache)`;
    - `compute_logits(hidden [N, hidden]) -> [N, vocab_size]` (float32).
    """

    # Checkpoint names that carry no weights of ours (e.g. precomputed rotary buffers).
    ignored_weight_suffixes: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        ".attn.bias",
        ".attn.masked_bias",
    )
    tied_weights: dict[str, str] = {}  # our name -> the name it shares storage with

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str | None:
        """Maps a checkpoint tensor name to ours (None: skip). Override for prefixes."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors into parameters by name; every parameter must be set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is None or name.endswith(self.ignored_weight_suffixes):
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {raw_name!r} has no parameter in {type(self).__name__}"
                )
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        for ours, source in self.tied_weights.items():
            if source in loaded:
                loaded.add(ours)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
