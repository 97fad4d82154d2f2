"""What Qwen3-Next adds to Qwen 3.5's layers, against transformers' own modules: the
fused DeltaNet projections split at load into the separate ones (rows in the order of
HF's `fix_query_key_value_ordering`), sparse blocks with a sigmoid-gated shared expert
beside a dense layer (`mlp_only_layers`), the multi-token-prediction head skipped.

The whole model's logits against HF's (prefill, chunks across blocks, decode, prefix
hits) are checked in test_qwen3_5.py, through the engine in test_linear_attention.py and
test_hf_parity.py."""

from __future__ import annotations

import functools

import torch

from engine.worker.attention import ReferenceBackend
from engine.worker.models.llama import LlamaMLP
from engine.worker.models.mixtral import SparseMoeBlock
from engine.worker.models.qwen3_next import FusedProjections, Qwen3NextForCausalLM
from engine.worker.models.registry import resolve_model_class
from tests.engine.tiny_models import build_hf_model


@functools.cache
def hf_model() -> torch.nn.Module:
    return build_hf_model("qwen3-next")


def our_model(weights=None) -> Qwen3NextForCausalLM:
    model = Qwen3NextForCausalLM(hf_model().config, ReferenceBackend())
    model.load_weights(weights if weights is not None else hf_model().state_dict().items())
    return model.eval()


def random_hidden(n: int, seed: int) -> torch.Tensor:  # [n, hidden_size]
    size = hf_model().config.hidden_size
    return torch.randn(n, size, generator=torch.Generator().manual_seed(seed))


def test_the_registry_names_the_class() -> None:
    assert resolve_model_class("Qwen3NextForCausalLM") is Qwen3NextForCausalLM


def test_fused_rows_split_in_transformers_order() -> None:
    """Row ids through HF's reordering of projected rows and through our split of the
    weight's rows come out in the same order (a permutation, exact)."""
    hf_layer = hf_model().model.layers[0].linear_attn
    split = FusedProjections.of(hf_model().config)
    qkvz_rows, ba_rows = hf_layer.in_proj_qkvz.out_features, hf_layer.in_proj_ba.out_features
    ids = torch.arange(qkvz_rows, dtype=torch.float64)
    ba_ids = torch.arange(ba_rows, dtype=torch.float64)
    q, k, v, z, b, a = hf_layer.fix_query_key_value_ordering(ids[None, None], ba_ids[None, None])
    qkv, ours_z = split.split_qkvz(ids[:, None])  # [rows, 1]: each row its id
    ours_b, ours_a = split.split_ba(ba_ids[:, None])
    assert torch.equal(qkv[:, 0], torch.cat([x.reshape(-1) for x in (q, k, v)]))
    for ours, theirs in ((ours_z, z), (ours_b, b), (ours_a, a)):
        assert torch.equal(ours[:, 0], theirs.reshape(-1))


def test_loaded_projections_equal_transformers_split_ones() -> None:
    hf_layer = hf_model().model.layers[0].linear_attn
    layer = our_model().model.layers[0].self_attn  # the DeltaNet (`linear_attn` in HF)
    hidden = random_hidden(9, seed=0)
    with torch.no_grad():
        qkvz, ba = hf_layer.in_proj_qkvz(hidden[None]), hf_layer.in_proj_ba(hidden[None])
        q, k, v, z, b, a = hf_layer.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([x.reshape(9, -1) for x in (q, k, v)], dim=-1)  # [T, conv_dim]
        for ours, theirs in (
            (layer.in_proj_qkv(hidden), mixed),
            (layer.in_proj_z(hidden), z.reshape(9, -1)),
            (layer.in_proj_b(hidden), b[0]),
            (layer.in_proj_a(hidden), a[0]),
        ):
            torch.testing.assert_close(ours, theirs)


def test_sparse_blocks_with_a_shared_expert_equal_transformers() -> None:
    """Layers 0, 2, 3: routed experts plus the gated shared expert; layer 1 dense."""
    model = our_model()
    hidden, hf_layers = random_hidden(13, seed=1), hf_model().model.layers
    for index, (ours, theirs) in enumerate(zip(model.model.layers, hf_layers, strict=True)):
        assert isinstance(ours.mlp, LlamaMLP if index == 1 else SparseMoeBlock)
        with torch.no_grad():
            expected = theirs.mlp(hidden[None])[0]
            torch.testing.assert_close(ours.mlp(hidden), expected, atol=1e-6, rtol=1e-5)
    shared = model.model.layers[0].mlp.shared_expert
    assert shared.down_proj.weight.shape[1] == hf_model().config.shared_expert_intermediate_size


def test_the_multi_token_prediction_head_is_skipped() -> None:
    extra = [("mtp.fc.weight", torch.zeros(64, 128)), ("mtp.norm.weight", torch.zeros(64))]
    model = our_model([*hf_model().state_dict().items(), *extra])
    assert not any(name.startswith("mtp") for name, _ in model.named_parameters())
