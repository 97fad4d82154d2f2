"""Tiny random-weight Hugging Face checkpoints, one per supported architecture."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers as hf

VOCAB = 256
# Shared shapes: 64 hidden, 2 layers, 4 heads (2 KV heads in the Llama family).
LLAMA_FIELDS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
GPT2_FIELDS = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)
_SHARED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
OPT_FIELDS = {**{k: LLAMA_FIELDS[k] for k in _SHARED}, "ffn_dim": 128}

# Gemma: head_dim apart from hidden/heads, windowed and full layers (`layer_types`)
# with a window shorter than most test prompts; soft caps that bite at these weights.
_GEMMA_SHARED = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    max_position_embeddings=128,
    hidden_activation="gelu_pytorch_tanh",
)
GEMMA2_FIELDS = dict(
    _GEMMA_SHARED,
    num_hidden_layers=3,
    num_key_value_heads=2,
    head_dim=24,
    query_pre_attn_scalar=2,  # with the soft cap: greedy tokens of 2 test prompts change
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    attn_logit_softcapping=1.5,
    final_logit_softcapping=3.0,  # logits reach 2.5: it bends them (greedy keeps its order)
)
# Gemma 3: one KV head (replicated under tensor parallelism), a rotary per layer type.
GEMMA3_FIELDS = dict(
    _GEMMA_SHARED,
    num_hidden_layers=4,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
)
# Phi-3: a window on every layer, partial longrope rotary; the test sequences stay
# within original_max_position_embeddings (the short factors, scaled cos/sin).
PHI3_FIELDS = dict(
    LLAMA_FIELDS,
    num_hidden_layers=3,
    original_max_position_embeddings=64,
    sliding_window=9,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
    },
)

# Mixtures of experts: 4 experts, top 2, an expert intermediate size whose half (one
# rank's slice under tensor parallelism) is odd.
MIXTRAL_FIELDS = dict(
    LLAMA_FIELDS, intermediate_size=42, num_local_experts=4, num_experts_per_tok=2
)
# Qwen3-MoE: layer 1 dense (`mlp_only_layers`), the others sparse.
QWEN3_MOE_FIELDS = dict(
    LLAMA_FIELDS,
    num_hidden_layers=3,
    moe_intermediate_size=42,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)
# GPT-OSS: sliding (window 8) and full layers alternating, YaRN with its ramp inside
# the 8 frequencies, biases everywhere, attention sinks.
GPT_OSS_FIELDS = dict(
    LLAMA_FIELDS,
    num_hidden_layers=3,
    head_dim=16,
    intermediate_size=42,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
)
# Qwen 3.5: three Gated DeltaNet (linear-attention) layers, then gated full attention
# with partial rotary (a quarter of each head); 4 value heads over 2 key heads.
# rms_norm_eps 1e-5, not 1e-6: the gated norm of a near-zero DeltaNet output (a strong
# decay, q nearly orthogonal to k) then scales float32 rounding by ~1000, and a 1e-6
# nudge of one layer moves transformers' own float32 logits by 2e-4.
QWEN3_5_FIELDS = dict(
    LLAMA_FIELDS,
    num_hidden_layers=4,
    rms_norm_eps=1e-5,
    head_dim=16,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
# Qwen3-Next: Qwen 3.5's layers (fused DeltaNet projections in the checkpoint) and sparse
# blocks of 4 experts, top 2, each beside a shared expert; layer 1's feed-forward dense
# (`mlp_only_layers`). The sizes pick weights under which float32 rounding stays small:
# with others (42 and 48), one DeltaNet output near zero at one position takes the
# rounding of a change in how the delta rule is chunked (block segments or not: HF's own
# recurrent path differs from its chunked one as much) to 1.2e-4 in the logits.
QWEN3_NEXT_FIELDS = dict(
    QWEN3_5_FIELDS,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)

# name -> (config class, model class, config fields)
ARCHITECTURES = {
    "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, LLAMA_FIELDS),
    "mistral": (hf.MistralConfig, hf.MistralForCausalLM, {**LLAMA_FIELDS, "sliding_window": None}),
    # A window shorter than most test prompts, so it matters.
    "mistral-window": (
        hf.MistralConfig,
        hf.MistralForCausalLM,
        {**LLAMA_FIELDS, "sliding_window": 7},
    ),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, LLAMA_FIELDS),
    # A full-attention layer, then a sliding-window one: two KV cache groups.
    "qwen2-hybrid": (
        hf.Qwen2Config,
        hf.Qwen2ForCausalLM,
        {**LLAMA_FIELDS, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, {**LLAMA_FIELDS, "head_dim": 32}),
    "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, GPT2_FIELDS),
    "opt": (hf.OPTConfig, hf.OPTForCausalLM, OPT_FIELDS),
    "mixtral": (hf.MixtralConfig, hf.MixtralForCausalLM, MIXTRAL_FIELDS),
    "qwen3-moe": (hf.Qwen3MoeConfig, hf.Qwen3MoeForCausalLM, QWEN3_MOE_FIELDS),
    "gpt-oss": (hf.GptOssConfig, hf.GptOssForCausalLM, GPT_OSS_FIELDS),
    "gemma2": (hf.Gemma2Config, hf.Gemma2ForCausalLM, GEMMA2_FIELDS),
    "gemma3": (hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, GEMMA3_FIELDS),
    "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, PHI3_FIELDS),
    "qwen3.5": (hf.Qwen3_5TextConfig, hf.Qwen3_5ForCausalLM, QWEN3_5_FIELDS),
    "qwen3-next": (hf.Qwen3NextConfig, hf.Qwen3NextForCausalLM, QWEN3_NEXT_FIELDS),
}


def build_hf_model(name: str, seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    """A float32 HF model with weights large enough that greedy choices are clear-cut."""
    config_cls, model_cls, fields = ARCHITECTURES[name]
    config = config_cls(  # a copy: configs rewrite nested fields (rope_parameters) in place
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **copy.deepcopy(fields),
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Experts by transformers' own loop (its default grouped_mm wants 16-byte strides).
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def save_hf_model(
    name: str, directory: Path, seed: int = 0, vocab_size: int = VOCAB
) -> torch.nn.Module:
    model = build_hf_model(name, seed, vocab_size)
    model.save_pretrained(directory)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` on one unpadded prompt."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_beams(model, prompt, width, length_penalty, early_stopping, max_new, eos=None):
    """transformers' own beam search on one prompt: each beam's new tokens (cut after
    `eos`) and scores (None for width 1)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=eos if eos is not None else 0,
        eos_token_id=eos,
    )
    sequences = [s[len(prompt) :].tolist() for s in out.sequences]
    if eos is not None:  # finished beams are padded with eos after their end
        sequences = [s[: s.index(eos) + 1] if eos in s else s for s in sequences]
    scores = out.sequences_scores.tolist() if width > 1 else None
    return sequences, scores


def kv_memory(
    model_dir: str,
    num_blocks: int,
    block_size: int,
    world_size: int = 1,
    kv_cache_dtype: str = "auto",
    pipeline_parallel_size: int = 1,
) -> int:
    """The kv_cache_memory that holds exactly `num_blocks` blocks of this checkpoint on
    each of `world_size` tensor-parallel ranks in `kv_cache_dtype` (read from its
    config.json; no weights are loaded); with pipeline stages, on the stage holding the
    most layers (the others hold more blocks; the ranks agree on the fewest)."""
    from engine.config import KVCacheDtype
    from engine.engine_args import EngineArgs
    from engine.worker.kv_cache import block_bytes

    model = EngineArgs(model=str(model_dir), skip_tokenizer_init=True).build().model
    dtype = KVCacheDtype.parse(kv_cache_dtype)
    layers = -(-model.num_layers // pipeline_parallel_size)
    return block_bytes(model, block_size, world_size, dtype, layers) * num_blocks


# Engine settings the protocol tests share: small blocks so tables grow, a short context.
SMALL_ENGINE = dict(
    skip_tokenizer_init=True, block_size=4, max_model_len=64, kv_cache_memory=1 << 20
)


def random_prompts(rng, n: int, max_len: int = 30) -> list[list[int]]:
    """`n` token-id prompts of 1 to `max_len` tokens over the tiny vocabulary."""
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
