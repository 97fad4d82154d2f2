"""A random-weight Llama GGUF at a real model's shapes, quantized as llama.cpp's Q4_K_M
recipe lays it out, written straight from random blocks (no float checkpoint: an 8B one
would need 32 GB), with a real tokenizer's metadata copied from another GGUF.

Q4_K_M (llama.cpp's `llama_model_quantize`): every matrix Q4_K, except the output head
(Q6_K) and, in the layers `use_more_bits` picks (the first and last eighth and every
third between), attn_v and ffn_down (Q6_K); norms F32. Each block gets random quants and
sub-block scales and a small super-block scale, so weights are about N(0, 0.02)-sized:
the model's text is noise, its memory and speed are an 8B model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

Q4_K_M_FILE_TYPE = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


@dataclass(frozen=True)
class LlamaShape:
    """The shapes that matter (Llama-3-8B's by default, with the donor's vocabulary)."""

    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    context: int = 8192
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random Q4_K or Q6_K blocks with sane scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elements, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // elements, size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:  # [d f16][dmin f16][scales 12][qs 128]
        # w = d * scale * q - dmin * min, scales and mins 0..63, q 0..15
        scales = rng.uniform(1.0e-5, 2.5e-5, size=(rows, cols // elements, 2))
        blocks[..., :4] = scales.astype(np.float16).view(np.uint8)
    elif qtype == GGMLQuantizationType.Q6_K:  # [ql 128][qh 64][scales 16 int8][d f16]
        d = rng.uniform(3.0e-6, 6.0e-6, size=(rows, cols // elements, 1))
        blocks[..., -2:] = d.astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"random blocks of {qtype.name} are not written here")
    return blocks.reshape(rows, -1)


def write_random_q4_k_m(path: Path, shape: LlamaShape, donor: Path, seed: int = 0) -> Path:
    """Writes the model to `path` with `donor`'s tokenizer (its `tokenizer.*` keys and
    vocabulary size); returns `path`."""
    import gguf

    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    reader = gguf.GGUFReader(str(donor))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random Llama {shape.layers}x{shape.hidden} Q4_K_M")
    writer.add_file_type(Q4_K_M_FILE_TYPE)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    _copy_tokenizer(reader, writer)
    kv = shape.kv_heads * shape.head_dim
    writer.add_tensor(
        "token_embd.weight", random_blocks(vocab, shape.hidden, q4, rng), raw_dtype=q4
    )
    for i in range(shape.layers):
        more = q6 if use_more_bits(i, shape.layers) else q4
        matrices = {
            "attn_q": (shape.hidden, shape.hidden, q4),
            "attn_k": (kv, shape.hidden, q4),
            "attn_v": (kv, shape.hidden, more),
            "attn_output": (shape.hidden, shape.hidden, q4),
            "ffn_gate": (shape.intermediate, shape.hidden, q4),
            "ffn_up": (shape.intermediate, shape.hidden, q4),
            "ffn_down": (shape.hidden, shape.intermediate, more),
        }
        for name, (rows, cols, qtype) in matrices.items():
            blocks = random_blocks(rows, cols, qtype, rng)
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(shape.hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    writer.add_tensor("output.weight", random_blocks(vocab, shape.hidden, q6, rng), raw_dtype=q6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(reader, writer) -> None:
    """Every `tokenizer.*` key of the donor, with its type."""
    import gguf

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)
