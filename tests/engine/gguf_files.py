"""Writes GGUF files for tests from a Hugging Face directory, the way llama.cpp's
converter lays them out (names, q/k row permutation for Llama, metadata keys), with the
tensors quantized to one type, plus the HF "twin" holding exactly the weights the GGUF
decodes to (dequantize(quantize(w))), so the two must generate the same tokens; and a
minimal GGUF of a few hundred bytes (header checks). Needs no torch until a twin is
written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[part]}.{kind}"
    return f"{HF_TO_GGUF[stem]}.{kind}"


def permute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf_and_twin(hf_dir: Path, gguf_path: Path, twin_dir: Path, qtype, arch="llama"):
    """GGUF of `hf_dir` with every 2-D weight whose rows fit the type's blocks stored as
    `qtype` (the rest F32, as llama.cpp does), and `twin_dir`: `hf_dir` with the weights
    the GGUF decodes to."""
    import gguf
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    _write_config(writer, config)
    _write_tokenizer(writer, hf_dir)
    twin = {}
    for name, tensor in weights.items():
        values = tensor.float().numpy()
        stored, decoded = _encode(values, qtype)
        twin[name] = torch.from_numpy(decoded.reshape(values.shape).copy())
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # Rows are quantized one by one, so permuting before quantizing decodes to
            # the permuted twin exactly.
            kv = "k_proj" in name
            heads = config["num_key_value_heads" if kv else "num_attention_heads"]
            stored, _ = _encode(permute_rotary_rows(values, heads), qtype)
        writer.add_tensor(gguf_name(name), stored[0], raw_dtype=stored[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copytree(hf_dir, twin_dir)
    save_file(twin, str(twin_dir / "model.safetensors"))


def write_minimal_gguf(path: Path, arch: str = "llama", **metadata) -> Path:
    """A small well-formed GGUF: `arch`, 4 heads (2 KV heads), a 16-piece vocabulary and
    one 8x4 F32 tensor; `metadata` adds or replaces keys (a value's GGUF type follows its
    Python type: str, int -> UINT32, float -> FLOAT32, list)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    fields = {
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(16)],
        "tokenizer.ggml.token_type": [1] * 16,
        **metadata,
    }
    for key, value in fields.items():
        writer.add_key_value(
            key, value, _gguf_type(value), _gguf_type(value[0]) if isinstance(value, list) else None
        )
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_type(value):
    from gguf import GGUFValueType

    kinds = {str: GGUFValueType.STRING, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32}
    return GGUFValueType.ARRAY if isinstance(value, list) else kinds[type(value)]


def _encode(values: np.ndarray, qtype):
    """((array to write, its GGML type), the float32 values it decodes to)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    block = GGML_QUANT_SIZES[qtype][0]
    if qtype == GGMLQuantizationType.F32 or values.ndim < 2 or values.shape[-1] % block:
        return (values, GGMLQuantizationType.F32), values
    if qtype == GGMLQuantizationType.F16:
        half = values.astype(np.float16)
        return (half, qtype), half.astype(np.float32)
    packed = quants.quantize(values, qtype)
    return (packed, qtype), quants.dequantize(packed, qtype).reshape(values.shape)


def _write_config(writer, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")
    writer.add_rope_freq_base(float(theta or 10000.0))
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer, hf_dir: Path) -> None:
    """A byte-level BPE ("gpt2") vocabulary, as llama.cpp stores one."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    vocab.update(special)
    tokens = [piece for piece, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL / NORMAL
    merges = tokenizer["model"].get("merges") or []
    if merges:
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    else:  # a pure byte vocabulary: transformers then derives (no) merges from scores
        writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(special[tok_config["bos_token"]])
    writer.add_eos_token_id(special[tok_config["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])
