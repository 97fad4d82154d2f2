"""The contract every model class fulfils, and the shared weight loading."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    QUANTIZED_LAYERS,
    ParallelLMHead,
    VocabParallelEmbedding,
    check_shape,
)
from engine.worker.parallel.pipeline import (
    NO_LINK,
    MissingModule,
    NoLink,
    PipelineLayout,
    PipelineStage,
    StageLink,
)
from engine.worker.quantized_weight import QuantizedTensor


class CausalLM(nn.Module):
    """A decoder-only LM over a flattened batch and a paged KV cache.

    Subclasses name their parameters exactly as the Hugging Face checkpoint does, so
    `load_weights` copies tensors by name; a module with a `load(name, tensor, part)`
    method (the tensor-parallel layers) takes the whole checkpoint tensor and keeps its
    rank's slice. Contract:
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
    # what pipeline stages split (None: the class cannot be split into stages)
    pipeline_layout: PipelineLayout | None = None
    # module paths another stage holds (`keep_stage`): their checkpoint tensors are skipped
    elsewhere: tuple[str, ...] = ()
    stage_renames: dict[str, str] = {}  # an embedding's tensor that fills a tied head
    stage_link: StageLink | NoLink = NO_LINK  # a pipeline stage's hops (`keep_stage`)

    def backbone(self) -> nn.Module:
        """The HF-named module under the head (`model`, `transformer`): input ids in,
        final hidden states out."""
        raise NotImplementedError

    def init_lm_head(
        self, hidden_size: int, vocab_size: int, tie_to: str | None, group: TensorParallelGroup
    ) -> None:
        """An LM head (this rank's vocabulary slice), sharing the embedding named
        `tie_to` (e.g. `model.embed_tokens`, a VocabParallelEmbedding over the same slice)."""
        self.lm_head = ParallelLMHead(vocab_size, hidden_size, group)
        if tie_to is not None:
            self.lm_head.weight = self.get_submodule(tie_to).weight
            self.tied_weights = {"lm_head.weight": f"{tie_to}.weight"}

    def keep_stage(self, stage: PipelineStage, link: StageLink) -> None:
        """Drops what other stages hold (their layers; the embeddings unless this is the
        first stage; the final norm and head unless it is the last) and hands the layer
        loop its `link`. A head tied to an embedding this stage lacks loads that
        embedding's checkpoint tensor itself."""
        layout = self.pipeline_layout
        if layout is None:
            raise ValueError(f"{type(self).__name__} cannot be split into pipeline stages")
        layers = self.get_submodule(layout.layers)
        kept = stage.layer_range(len(layers))
        dropped = [f"{layout.layers}.{i}" for i in range(len(layers)) if i not in kept]
        dropped += list(layout.first) if stage.receives else []
        dropped += list(layout.last) if stage.sends else []
        for path in dropped:
            parent, _, leaf = path.rpartition(".")
            owner = self.get_submodule(parent) if parent else self
            if getattr(owner, leaf, None) is not None:
                setattr(owner, leaf, MissingModule())
        self.elsewhere = tuple(dropped)
        if self.tied_weights and stage.receives and not stage.sends:
            ((head, source),) = self.tied_weights.items()
            self.stage_renames = {source: head}  # the head keeps its own copy
            self.tied_weights = {}
        self.get_submodule(layout.loop).pp = link
        self.stage_link = link

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

    def _stage_name(self, name: str) -> str | None:
        """`name` on this pipeline stage: None for another stage's tensor; a tied head's
        embedding tensor under the head's name where this stage lacks the embedding."""
        renames = self.stage_renames
        if name in renames:
            return renames[name]
        if any(name.startswith(path + ".") for path in self.elsewhere):
            return None
        if name == "lm_head.weight" and renames:
            return None  # the embedding's tensor fills the head here
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors into parameters by name; every parameter must be set.

        A checkpoint tensor whose name matches `stacked_params` (e.g. `.q_proj.`) loads
        into its part of a fused column-parallel layer (e.g. rows of `.qkv_proj.`); a
        checkpoint that stores the fused tensor itself (Phi-3's `qkv_proj`) fills every
        part at once, each rank keeping its slice of each.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int | None]] = set()
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is not None and self.elsewhere:
                name = self._stage_name(name)
            if name is None or name.endswith(self.ignored_weight_suffixes):
                continue
            target, part = self._stacked_target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {raw_name!r} has no parameter in {type(self).__name__}"
                )
            try:
                self._load_one(target, params[target], tensor, part)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {raw_name!r} {exc}") from None
            loaded.update(self._parts_filled(target, part))
        for ours, source in self.tied_weights.items():
            if (source, None) in loaded:
                loaded.add((ours, None))
                self._tie(ours, source)
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in self._expected() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _tie(self, ours: str, source: str) -> None:
        """A tied head shares what its embedding loaded (the rows in blocks, if so)."""
        head = self.get_submodule(ours.rpartition(".")[0])
        embedding = self.get_submodule(source.rpartition(".")[0])
        if isinstance(head, ParallelLMHead) and isinstance(embedding, VocabParallelEmbedding):
            head.tie_to(embedding)

    def _stacked_target(self, name: str) -> tuple[str, int | None]:
        for piece, (fused, index) in self.stacked_params.items():
            if piece in name:
                return name.replace(piece, fused), index
        return name, None

    def _parts_filled(self, target: str, part: int | None) -> set[tuple[str, int | None]]:
        """What loading a tensor into `target` sets: its part, or with None every part
        of a layer that expects its parts apart (`checkpoint_parts`)."""
        if part is not None:
            return {(target, part)}
        parts = self._checkpoint_parts(target)
        return {(target, None)} if parts is None else {(target, i) for i in range(parts)}

    def _checkpoint_parts(self, target: str) -> int | None:
        """How many checkpoint tensors fill parameter `target` apart (None: one): its
        module's `checkpoint_parts`, one count or a count per parameter (FusedMoE)."""
        module_name, _, leaf = target.rpartition(".")
        module = self.get_submodule(module_name) if module_name else self
        parts = getattr(module, "checkpoint_parts", None)
        return parts.get(leaf) if isinstance(parts, dict) else parts

    def _load_one(
        self, target: str, param: nn.Parameter, tensor: torch.Tensor, part: int | None
    ) -> None:
        module_name, _, leaf = target.rpartition(".")
        module = self.get_submodule(module_name) if module_name else self
        if isinstance(tensor, QuantizedTensor) and not isinstance(module, QUANTIZED_LAYERS):
            tensor = tensor.dequantize().to(param.dtype)  # only linear layers compute in blocks
        if hasattr(module, "load"):  # SLICING_LAYERS, FusedMoE: it keeps its rank's slice
            module.load(leaf, tensor, part)
            return
        check_shape(tensor, param.shape)
        with torch.no_grad():
            param.copy_(tensor)

    def _expected(self) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            parts = self._checkpoint_parts(name)
            if parts is None:
                expected.add((name, None))
            else:
                expected.update((name, i) for i in range(parts))
        return expected
