"""Tiny random-weight Hugging Face checkpoints, one per supported architecture."""

from __future__ import annotations

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
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, {**LLAMA_FIELDS, "head_dim": 32}),
    "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, GPT2_FIELDS),
    "opt": (hf.OPTConfig, hf.OPTForCausalLM, OPT_FIELDS),
}


def build_hf_model(name: str, seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    """A float32 HF model with weights large enough that greedy choices are clear-cut."""
    config_cls, model_cls, fields = ARCHITECTURES[name]
    config = config_cls(
        vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
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


def kv_memory(model_dir: str, num_blocks: int, block_size: int, world_size: int = 1) -> int:
    """The kv_cache_memory that holds exactly `num_blocks` blocks of this checkpoint on
    each of `world_size` tensor-parallel ranks (read from its config.json; no weights
    are loaded)."""
    from engine.engine_args import EngineArgs
    from engine.worker.kv_cache import block_bytes

    model = EngineArgs(model=str(model_dir), skip_tokenizer_init=True).build().model
    return block_bytes(model, block_size, world_size) * num_blocks


# Engine settings the protocol tests share: small blocks so tables grow, a short context.
SMALL_ENGINE = dict(
    skip_tokenizer_init=True, block_size=4, max_model_len=64, kv_cache_memory=1 << 20
)


def random_prompts(rng, n: int, max_len: int = 30) -> list[list[int]]:
    """`n` token-id prompts of 1 to `max_len` tokens over the tiny vocabulary."""
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
