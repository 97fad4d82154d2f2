"""Our model code against Hugging Face transformers on the same (tiny, random) weights.

Each case builds a small random HF model, copies its state_dict into our class through
`load_weights`, and compares logits: (a) one sequence's whole prompt in one step, and
(b) a mixed paged batch (a prompt prefilled in two chunks beside a sequence decoding
token by token, then both decoding) with block size 4 and shuffled block tables.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers as hf

from engine.worker.attention import AttentionMetadata, ReferenceBackend, SdpaBackend
from engine.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.worker.models.gpt2 import GPT2LMHeadModel
from engine.worker.models.gpt_oss import GptOssForCausalLM
from engine.worker.models.layer_ops import TORCH_LAYER_OPS
from engine.worker.models.layers import PagedAttention
from engine.worker.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from engine.worker.models.mixtral import MixtralForCausalLM, Qwen3MoeForCausalLM
from engine.worker.models.opt import OPTForCausalLM
from engine.worker.models.phi3 import Phi3ForCausalLM
from tests.engine.native_backend import native_backend
from tests.engine.tiny_models import (
    GEMMA2_FIELDS,
    GEMMA3_FIELDS,
    GPT2_FIELDS,
    GPT_OSS_FIELDS,
    LLAMA_FIELDS,
    MIXTRAL_FIELDS,
    OPT_FIELDS,
    PHI3_FIELDS,
    QWEN3_MOE_FIELDS,
)

VOCAB, BLOCK_SIZE, NUM_BLOCKS, ATOL = 128, 4, 16, 1e-4

_LLAMA = {**LLAMA_FIELDS, "vocab_size": VOCAB}
_GPT2 = {**GPT2_FIELDS, "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
_OPT = {**OPT_FIELDS, "vocab_size": VOCAB}
_PHI3 = {**PHI3_FIELDS, "vocab_size": VOCAB, "pad_token_id": None}

# case id -> (HF config class, HF model class, our class, config overrides)
CASES = {
    "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, LlamaForCausalLM, _LLAMA),
    "llama-tied": (
        hf.LlamaConfig,
        hf.LlamaForCausalLM,
        LlamaForCausalLM,
        {**_LLAMA, "tie_word_embeddings": True},
    ),
    "mistral": (
        hf.MistralConfig,
        hf.MistralForCausalLM,
        MistralForCausalLM,
        {**_LLAMA, "sliding_window": None},
    ),
    # A window shorter than the prompts (11 tokens; 15 and 9 in the mixed batch).
    "mistral-window": (
        hf.MistralConfig,
        hf.MistralForCausalLM,
        MistralForCausalLM,
        {**_LLAMA, "sliding_window": 5},
    ),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, Qwen2ForCausalLM, _LLAMA),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, Qwen3ForCausalLM, {**_LLAMA, "head_dim": 32}),
    "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, GPT2LMHeadModel, _GPT2),
    "gpt2-inverse-layer-scale": (
        hf.GPT2Config,
        hf.GPT2LMHeadModel,
        GPT2LMHeadModel,
        {**_GPT2, "scale_attn_by_inverse_layer_idx": True, "activation_function": "gelu"},
    ),
    "opt": (hf.OPTConfig, hf.OPTForCausalLM, OPTForCausalLM, _OPT),
    "gemma2": (
        hf.Gemma2Config,
        hf.Gemma2ForCausalLM,
        Gemma2ForCausalLM,
        {**GEMMA2_FIELDS, "vocab_size": VOCAB},
    ),
    "gemma3": (
        hf.Gemma3TextConfig,
        hf.Gemma3ForCausalLM,
        Gemma3ForCausalLM,
        {**GEMMA3_FIELDS, "vocab_size": VOCAB, "final_logit_softcapping": 3.0},
    ),
    "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, Phi3ForCausalLM, _PHI3),
    # Every sequence below is longer than 4 tokens from its first step on: the long factors.
    "phi3-longrope-long": (
        hf.Phi3Config,
        hf.Phi3ForCausalLM,
        Phi3ForCausalLM,
        {**_PHI3, "original_max_position_embeddings": 4},
    ),
    "opt-project-in-out": (
        hf.OPTConfig,
        hf.OPTForCausalLM,
        OPTForCausalLM,
        {**_OPT, "word_embed_proj_dim": 32},
    ),
    "opt-post-norm": (
        hf.OPTConfig,
        hf.OPTForCausalLM,
        OPTForCausalLM,
        {**_OPT, "do_layer_norm_before": False, "word_embed_proj_dim": 32},
    ),
    "opt-no-bias-no-affine": (
        hf.OPTConfig,
        hf.OPTForCausalLM,
        OPTForCausalLM,
        {**_OPT, "enable_bias": False, "layer_norm_elementwise_affine": False},
    ),
    # Mixtures of experts, from transformers' in-memory (stacked) expert weights.
    "mixtral": (
        hf.MixtralConfig,
        hf.MixtralForCausalLM,
        MixtralForCausalLM,
        {**MIXTRAL_FIELDS, "vocab_size": VOCAB},
    ),
    "qwen3-moe": (
        hf.Qwen3MoeConfig,
        hf.Qwen3MoeForCausalLM,
        Qwen3MoeForCausalLM,
        {**QWEN3_MOE_FIELDS, "vocab_size": VOCAB},
    ),
    "qwen3-moe-every-second-layer": (
        hf.Qwen3MoeConfig,
        hf.Qwen3MoeForCausalLM,
        Qwen3MoeForCausalLM,
        {
            **QWEN3_MOE_FIELDS,
            "vocab_size": VOCAB,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [],
            "norm_topk_prob": False,
        },
    ),
    "gpt-oss": (
        hf.GptOssConfig,
        hf.GptOssForCausalLM,
        GptOssForCausalLM,
        {**GPT_OSS_FIELDS, "vocab_size": VOCAB},
    ),
}


BACKENDS = {"reference": ReferenceBackend, "sdpa": SdpaBackend, "native": native_backend}


@functools.cache
def hf_model(case: str):
    """A seeded random float32 HF model; every parameter is perturbed so that biases and
    norm weights are not their trivial initial values."""
    config_cls, model_cls, _, overrides = CASES[case]
    torch.manual_seed(0)
    config = config_cls(**copy.deepcopy(overrides))  # configs rewrite nested fields
    model = model_cls(config).float().eval()
    model.set_experts_implementation("eager")  # transformers' loop (grouped_mm: 16-byte strides)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def our_model(case: str, backend: str, weights=None):
    model = hf_model(case)
    ours = CASES[case][2](model.config, BACKENDS[backend]()).float().eval()
    ours.load_weights(weights if weights is not None else model.state_dict().items())
    return ours


@functools.cache
def hf_logits(case: str, tokens: tuple[int, ...]) -> torch.Tensor:  # [T, vocab]
    with torch.no_grad():
        return hf_model(case)(torch.tensor([tokens])).logits[0].float()


def make_kv_caches(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed per-layer caches in the layout of the layer's attention backend."""
    attns = [m for m in model.modules() if isinstance(m, PagedAttention)]
    return [
        tuple(
            torch.zeros(
                a.backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, a.num_kv_heads, a.head_size)
            )
            for _ in "kv"
        )
        for a in attns
    ]


def make_metadata(
    rows: list[tuple[list[int], int, int]],
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for rows `(block_table, first_position, num_new_tokens)`.

    Decode rows (one new token) must come first, as the backends expect.
    """
    query_lens = tuple(n for _, _, n in rows)
    seq_lens = tuple(start + n for _, start, n in rows)
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(rows))
    assert all(n != 1 for n in query_lens[num_decodes:]), "decode rows must come first"
    width = max(len(table) for table, _, _ in rows)
    block_tables = torch.zeros(len(rows), width, dtype=torch.int64)
    positions, slots = [], []
    for i, (table, start, n) in enumerate(rows):
        block_tables[i, : len(table)] = torch.tensor(table)
        pos = torch.arange(start, start + n)
        positions.append(pos)
        slots.append(block_tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=block_tables,
        slot_mapping=torch.cat(slots),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        num_decodes=num_decodes,
    )
    return metadata, torch.cat(positions)


def random_tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())


def shuffled_blocks(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS, generator=g).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_full_prompt_matches_hf(case: str, backend: str) -> None:
    tokens = random_tokens(11, seed=1)
    expected = hf_logits(case, tokens)
    assert expected.std() > 100 * ATOL  # the comparison below is not vacuous
    model = our_model(case, backend)
    metadata, positions = make_metadata([(shuffled_blocks(2)[:3], 0, len(tokens))])
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), positions, make_kv_caches(model), metadata)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(tokens), VOCAB)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_mixed_paged_batch_matches_hf(case: str, backend: str) -> None:
    seq_a, seq_b = random_tokens(15, seed=3), random_tokens(9, seed=4)
    blocks = shuffled_blocks(5)
    table_a, table_b = blocks[:4], blocks[4:7]  # 15 and 9 tokens at block size 4
    # Each step: rows (sequence, table, first position, num new tokens), decodes first.
    steps = [
        [("b", table_b, 0, 5), ("a", table_a, 0, 6)],  # B's prompt, A's first chunk
        [("b", table_b, 5, 1), ("a", table_a, 6, 7)],  # B decodes, A's second chunk
        [("b", table_b, 6, 1), ("a", table_a, 13, 1)],  # both decode
        [("b", table_b, 7, 1), ("a", table_a, 14, 1)],
        [("b", table_b, 8, 1)],
    ]
    tokens = {"a": seq_a, "b": seq_b}
    model = our_model(case, backend)
    kv_caches = make_kv_caches(model)
    for step in steps:
        metadata, positions = make_metadata([(t, s, n) for _, t, s, n in step])
        input_ids = torch.tensor([i for name, _, s, n in step for i in tokens[name][s : s + n]])
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
        row_start = 0
        for name, _, start, n in step:
            expected = hf_logits(case, tokens[name])[start : start + n]
            got = logits[row_start : row_start + n]
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"{name}@{start}")
            row_start += n


def test_gpt2_loads_hub_names_without_prefix() -> None:
    """Hub GPT-2 files say `h.0.attn.c_attn.weight`, carry mask buffers, omit lm_head."""
    state = hf_model("gpt2").state_dict()
    weights = [
        (k.removeprefix("transformer."), v) for k, v in state.items() if k != "lm_head.weight"
    ]
    weights += [
        ("h.0.attn.bias", torch.ones(1, 1, 128, 128)),
        ("h.0.attn.masked_bias", torch.tensor(-1e4)),
    ]
    model = our_model("gpt2", "reference", weights)
    torch.testing.assert_close(
        model.transformer.h[0].attn.c_attn.bias, state["transformer.h.0.attn.c_attn.bias"]
    )
    assert model.lm_head.weight is model.transformer.wte.weight


def test_opt_loads_names_without_model_prefix() -> None:
    state = hf_model("opt-project-in-out").state_dict()
    weights = [(k.removeprefix("model."), v) for k, v in state.items()]
    model = our_model("opt-project-in-out", "reference", weights)
    torch.testing.assert_close(
        model.model.decoder.project_in.weight, state["model.decoder.project_in.weight"]
    )


def test_unsupported_configs_are_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="activation_function"):
        GPT2LMHeadModel(hf.GPT2Config(**_GPT2, activation_function="mish"), ReferenceBackend())
    with pytest.raises(ValueError, match="add_cross_attention"):
        GPT2LMHeadModel(hf.GPT2Config(**_GPT2, add_cross_attention=True), ReferenceBackend())


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_layer_ops_follow_the_attention_backend(backend: str) -> None:
    model = our_model("qwen3", backend)
    expected = "native" if backend == "native" else "torch"
    layer = model.model.layers[0]
    assert model.model.norm.ops.name == expected
    assert layer.mlp.ops.name == layer.self_attn.rotary_emb.ops.name == expected
    assert layer.self_attn.q_norm.ops.name == "torch"  # per head: not rows the kernel takes


def test_native_layer_ops_match_torch_ops_in_bfloat16() -> None:
    """The fused path (in-place residual stream, rotary in the QKV output) gives the torch
    path's logits over a mixed paged batch, up to bfloat16 rounding."""
    backend = native_backend()
    weights = hf_model("llama").state_dict().items()
    models = {}
    for name, ops in (("native", None), ("torch", TORCH_LAYER_OPS)):
        model = LlamaForCausalLM(hf_model("llama").config, backend, layer_ops=ops)
        model.load_weights(weights)
        models[name] = model.to(torch.bfloat16).eval()
    assert models["native"].model.norm.ops.name == "native"
    tokens = random_tokens(13, seed=6)
    blocks = shuffled_blocks(7)
    steps = [[(blocks[:2], 0, 1), (blocks[2:6], 0, 9)], [(blocks[:2], 1, 1), (blocks[2:6], 9, 4)]]
    logits = {}
    for name, model in models.items():
        caches = [(k.bfloat16(), v.bfloat16()) for k, v in make_kv_caches(model)]
        outs = []
        for rows in steps:
            metadata, positions = make_metadata(rows)
            ids = torch.tensor([tokens[(start + i) % 13] for _, start, n in rows for i in range(n)])
            with torch.no_grad():
                outs.append(model.compute_logits(model(ids, positions, caches, metadata)))
        logits[name] = torch.cat(outs)
    scale = logits["torch"].abs().max().item()
    torch.testing.assert_close(logits["native"], logits["torch"], atol=0.01 * scale, rtol=0)
