"""The tensors of a GGUF checkpoint (llama.cpp's file format), under Hugging Face names.

`GgufIndex.read(path)` parses the header with the `gguf` package (once: the side-car keeps
it, gguf_sidecar.py); `GgufCheckpoint(path, index)` memory-maps the file and yields
`(hf_name, tensor)` pairs that `CausalLM.load_weights` takes like a safetensors file's.

Contract:
- A file that is not a readable GGUF (empty, wrong magic, truncated, a corrupt header, a
  metadata key missing or of an unexpected type) raises ValueError naming the file and
  what is wrong (gguf_header.py), never the `gguf` package's own IndexError.
- Only the architectures in `GGUF_ARCHITECTURES` load; any other raises ValueError
  naming it. Their tensor names map one to one onto the HF names of our model classes.
- Every tensor is dequantized to float32 by `gguf.quants` (F32, F16, BF16, Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0 and the K- and I-quants it implements), then cast to the requested
  dtype. A tensor in a type the package cannot dequantize raises ValueError naming the
  tensor and the type.
- Llama GGUFs store `attn_q`/`attn_k` rows permuted for llama.cpp's rotary layout (its
  converter interleaves each head's two rotary halves); they are permuted back, so the
  weights equal the HF checkpoint's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.worker.gguf_header import GgufHeader

# GGUF `general.architecture` -> (HF architecture, whether q/k rows are permuted).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
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
# Tensors llama.cpp stores that HF checkpoints compute instead (llama 3's rope factors).
_SKIPPED = ("rope_freqs.weight",)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_architecture(header: GgufHeader) -> str:
    """The file's `general.architecture`, checked against GGUF_ARCHITECTURES."""
    arch = header.value("general.architecture", str)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported ({header.name}); pagedserve loads "
            f"GGUF files of {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return arch


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a
    tensor the HF model does not hold. Raises ValueError for a name it does not know."""
    if gguf_name in _SKIPPED:
        return None
    if match := _BLOCK.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the HF model")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: within each head, rows were reordered
    from (half, pair) to (pair, half). weight: [num_heads * head_size, ...]."""
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    return (
        weight.reshape(num_heads, pairs, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's bytes lie in the file. shape: HF order (outermost first)."""

    name: str
    qtype: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GgufIndex:
    """What loading needs from a GGUF file's header, kept as JSON in its side-car so a
    start does not parse the header again (the `gguf` package takes ~2 s over the 49k
    strings of a vocabulary)."""

    architecture: str
    num_heads: int
    num_kv_heads: int
    tensors: tuple[GgufTensor, ...]

    @classmethod
    def read(cls, path: str | Path) -> GgufIndex:
        """Parses the header with the `gguf` package; checks the architecture. A file it
        cannot read raises ValueError naming the file (gguf_header.py)."""
        header = GgufHeader(path)
        arch = gguf_architecture(header)
        num_heads = header.value(f"{arch}.attention.head_count", int)
        num_kv = header.value(f"{arch}.attention.head_count_kv", int, required=False)
        tensors = tuple(
            GgufTensor(
                t.name,
                int(t.tensor_type),
                tuple(int(d) for d in reversed(t.shape)),
                int(t.data_offset),
                int(t.n_bytes),
            )
            for t in header.tensors
        )
        return cls(arch, num_heads, num_kv if num_kv is not None else num_heads, tensors)

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "tensors": [[t.name, t.qtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
        }

    @classmethod
    def from_json(cls, data: dict) -> GgufIndex:
        tensors = tuple(
            GgufTensor(name, qtype, tuple(shape), offset, nbytes)
            for name, qtype, shape, offset, nbytes in data["tensors"]
        )
        return cls(data["architecture"], data["num_heads"], data["num_kv_heads"], tensors)

    @property
    def hf_architecture(self) -> str:
        return GGUF_ARCHITECTURES[self.architecture][0]

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]


class GgufCheckpoint:
    """One GGUF file, memory-mapped; `tensors(dtype)` dequantizes one tensor at a time."""

    def __init__(self, path: str | Path, index: GgufIndex) -> None:
        self.path = Path(path)
        self.index = index

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor in `dtype`) for every tensor the HF model holds."""
        permuted = GGUF_ARCHITECTURES[self.index.architecture][1]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        for entry in self.index.tensors:
            name = hf_tensor_name(entry.name)
            if name is None:
                continue
            data = raw[entry.offset : entry.offset + entry.nbytes]
            tensor = torch.from_numpy(_dequantize(entry, data))  # [rows, cols] or [n]
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                q = "q_proj" in name
                tensor = unpermute_rotary_rows(
                    tensor, self.index.num_heads if q else self.index.num_kv_heads
                )
            yield name, tensor.to(dtype)


def _dequantize(entry: GgufTensor, data: np.ndarray) -> np.ndarray:
    """float32 array in the HF layout, from the tensor's raw bytes."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(entry.qtype)
    try:
        values = quants.dequantize(data, qtype)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {entry.name!r} is stored as {qtype.name}, which the gguf package "
            "cannot dequantize; convert the file to F16, BF16, Q8_0, Q4_0, Q4_1 or a K-quant"
        ) from None
    return np.array(values, dtype=np.float32).reshape(entry.shape)  # a writable copy
