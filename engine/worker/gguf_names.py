"""llama.cpp's tensor names and layouts, per architecture, and how each becomes the
tensors of our model classes under Hugging Face checkpoint names.

One `GgufFamily` per `general.architecture` we load (Mixtral is llama.cpp's `llama`
with experts). Names follow llama.cpp's map (the `gguf` package's tensor_mapping.py);
`hf_tensors` undoes what llama.cpp's converter (convert_hf_to_gguf.py) did to each
tensor:
- Llama and Mistral (and Mixtral): `attn_q`/`attn_k` rows permuted for llama.cpp's
  rotary layout (each head's two rotary halves interleaved): permuted back.
- Gemma 2 and 3: every norm stored as w + 1 (their RMSNorm scales by 1 + w): 1 is
  subtracted in float32, before the cast to the model's dtype.
- Mixtral and Qwen3-MoE: experts stacked, `ffn_gate_exps` [n_expert, I, H] (likewise
  up; `ffn_down_exps` [n_expert, H, I]): split into the checkpoint's per-expert tensors.
- Phi-3: `attn_qkv` and `ffn_up` (gate rows, then up rows) are its fused `qkv_proj`
  and `gate_up_proj` as they are; longrope's factors (`rope_factors_long`/`_short`) are
  config, read by the side-car (gguf_sidecar.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich norms: llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp stores that HF checkpoints compute or keep in the config.
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class Experts:
    """A checkpoint's per-expert names: expert e's gate, up and down projections are
    `{block}.experts.{e}.{gate|up|down}.weight`, its router `{block}.gate.weight`."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class GgufFamily:
    """How one llama.cpp architecture's tensors become one of our model classes'."""

    hf_architecture: str
    block_names: Mapping[str, str]  # llama.cpp's block tensor -> HF's (`attn_q` -> q_proj)
    permuted: bool = False  # attn_q/attn_k rows in llama.cpp's rotary order
    norm_offset: bool = False  # norms stored as w + 1
    experts: Experts | None = None


FAMILIES = {
    "llama": GgufFamily("LlamaForCausalLM", _LLAMA_BLOCK, permuted=True),
    "mistral": GgufFamily("MistralForCausalLM", _LLAMA_BLOCK, permuted=True),
    "qwen2": GgufFamily("Qwen2ForCausalLM", _LLAMA_BLOCK),
    "qwen3": GgufFamily("Qwen3ForCausalLM", _LLAMA_BLOCK),
    "gemma2": GgufFamily("Gemma2ForCausalLM", _GEMMA_BLOCK, norm_offset=True),
    "gemma3": GgufFamily("Gemma3ForCausalLM", _GEMMA_BLOCK, norm_offset=True),
    "phi3": GgufFamily("Phi3ForCausalLM", _PHI3_BLOCK),
    "qwen3moe": GgufFamily(
        "Qwen3MoeForCausalLM",
        {**_LLAMA_BLOCK, "ffn_gate_inp": "mlp.gate"},
        experts=Experts("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
    # llama.cpp writes Mixtral as `llama` with experts (`llama.expert_count`).
    "mixtral": GgufFamily(
        "MixtralForCausalLM",
        {**_LLAMA_BLOCK, "ffn_gate_inp": "block_sparse_moe.gate"},
        permuted=True,
        experts=Experts("block_sparse_moe", "w1", "w3", "w2"),
    ),
}
GGUF_ARCHITECTURES = ("gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3moe")
# Architectures llama.cpp writes that we serve from safetensors but not from GGUF.
REFUSED = {
    "gpt-oss": (
        "transformers cannot read a GPT-OSS GGUF's config (its reader takes the length of "
        "each `gpt-oss.rope.scaling.*` key for its value); serve the safetensors checkpoint"
    ),
}


def family_name(architecture: str, num_experts: int) -> str:
    """The FAMILIES key of a file of llama.cpp's `architecture`."""
    return "mixtral" if architecture == "llama" and num_experts else architecture


def hf_tensor_name(gguf_name: str, family: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a
    tensor the HF model does not hold. Raises ValueError for a name it does not know
    (stacked experts included: `hf_tensors` splits those)."""
    if gguf_name in _SKIPPED:
        return None
    block_names = FAMILIES[family].block_names
    if match := _BLOCK.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in block_names:
            return f"model.layers.{layer}.{block_names[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GLOBAL:
            return f"{_GLOBAL[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the HF model")


def hf_tensors(
    family: str, gguf_name: str, tensor: torch.Tensor, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF checkpoint's (name, float32 tensor) pairs that one dequantized GGUF tensor
    holds (none, one, or one per expert), with llama.cpp's conversion undone."""
    spec = FAMILIES[family]
    match = _BLOCK.fullmatch(gguf_name)
    if spec.experts is not None and match and match[2] in _EXPERTS:
        layer, part, _ = match.groups()
        experts = spec.experts
        proj = (experts.gate, experts.up, experts.down)[_EXPERTS.index(part)]
        stem = f"model.layers.{layer}.{experts.block}.experts"
        for e in range(tensor.shape[0]):  # tensor: [n_expert, rows, cols]
            yield f"{stem}.{e}.{proj}.weight", tensor[e]
        return
    name = hf_tensor_name(gguf_name, family)
    if name is None:
        return
    if spec.norm_offset and name.endswith("norm.weight"):
        tensor = tensor - 1.0
    if spec.permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
        tensor = unpermute_rotary_rows(tensor, num_heads if "q_proj" in name else num_kv_heads)
    yield name, tensor


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: within each head, rows were reordered
    from (half, pair) to (pair, half). weight: [num_heads * head_size, ...]."""
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    return (
        weight.reshape(num_heads, pairs, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )
