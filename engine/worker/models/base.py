"""The contract every model class fulfils, and the shared weight loading."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.worker.attention.metadata import AttentionMetadata


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
    # checkpoint name part -> (our fused name part, shard index), e.g. q/k/v -> qkv_proj.
    stacked_params: dict[str, tuple[str, int]] = {}

    def backbone(self) -> nn.Module:
        """The HF-named module under the head (`model`, `transformer`): input ids in,
        final hidden states out."""
        raise NotImplementedError

    def init_lm_head(self, hidden_size: int, vocab_size: int, tie_to: str | None) -> None:
        """An LM head, sharing the embedding named `tie_to` (e.g. `model.embed_tokens`)."""
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_to is not None:
            self.lm_head.weight = self.get_submodule(tie_to).weight
            self.tied_weights = {"lm_head.weight": f"{tie_to}.weight"}

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.backbone()(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab_size]
        return self.lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str | None:
        """Maps a checkpoint tensor name to ours (None: skip). Subclasses add prefixes."""
        if name == "lm_head.weight" and "lm_head.weight" in self.tied_weights:
            return None  # tied: the embedding is the head
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors into parameters by name; every parameter must be set.

        A checkpoint tensor whose name matches `stacked_params` (e.g. `.q_proj.`) loads
        into its shard of a fused `MergedLinear` (e.g. rows of `.qkv_proj.`).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int | None]] = set()
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is None or name.endswith(self.ignored_weight_suffixes):
                continue
            target, shard = self._stacked_target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {raw_name!r} has no parameter in {type(self).__name__}"
                )
            dest = self._destination(params[target], target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add((target, shard))
        for ours, source in self.tied_weights.items():
            if (source, None) in loaded:
                loaded.add((ours, None))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in self._expected() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _stacked_target(self, name: str) -> tuple[str, int | None]:
        for part, (fused, index) in self.stacked_params.items():
            if part in name:
                return name.replace(part, fused), index
        return name, None

    def _destination(self, param: nn.Parameter, name: str, shard: int | None) -> torch.Tensor:
        if shard is None:
            return param
        module = self.get_submodule(name.rsplit(".", 1)[0])
        sizes = module.shard_sizes
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _expected(self) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            module = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            sizes = getattr(module, "shard_sizes", None)
            if sizes is None:
                expected.add((name, None))
            else:
                expected.update((name, i) for i in range(len(sizes)))
        return expected
