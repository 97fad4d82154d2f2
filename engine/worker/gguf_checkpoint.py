"""The tensors of a GGUF checkpoint (llama.cpp's file format), under Hugging Face names.

`GgufIndex.read(path)` parses the header with the `gguf` package (once: the side-car keeps
it, gguf_sidecar.py); `GgufCheckpoint(path, index)` memory-maps the file and yields
`(hf_name, tensor)` pairs that `CausalLM.load_weights` takes like a safetensors file's.

Contract:
- A file that is not a readable GGUF (empty, wrong magic, truncated, a corrupt header, a
  metadata key missing or of an unexpected type) raises ValueError naming the file and
  what is wrong (gguf_header.py), never the `gguf` package's own IndexError.
- Only the architectures in `GGUF_ARCHITECTURES` load (Llama, Mistral, Qwen2, Qwen3,
  Gemma 2, Gemma 3, Phi-3, Qwen3-MoE, and Mixtral: llama.cpp's `llama` with experts);
  any other raises ValueError naming it (and, for one in `REFUSED`, why). Their tensor
  names map onto the HF names of our model classes (gguf_names.py), a tensor of no known
  name raises ValueError naming it.
- A matrix in a type the caller keeps in blocks (`keep_blocks`: those with a native
  kernel, under `--quantization gguf`) comes as a `QuantizedTensor` of its own bytes.
- Every other tensor is dequantized to float32 by `gguf.quants` (F32, F16, BF16, Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 and the K- and I-quants it implements), then cast to the
  requested dtype. A tensor in a type the package cannot dequantize raises ValueError
  naming the tensor and the type.
- What llama.cpp's converter did to a tensor is undone in float32 before the cast
  (gguf_names.py): Llama's permuted q/k rows, Gemma's norms stored as w + 1, experts
  stacked [n_expert, ...]; so the weights equal the HF checkpoint's (blocks go through
  the same row operations).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cuda_ext.quant_gemm import QuantType, row_bytes
from engine.worker.gguf_header import GgufHeader
from engine.worker.gguf_names import (
    FAMILIES,
    GGUF_ARCHITECTURES,
    REFUSED,
    family_name,
    hf_tensor_name,
    hf_tensors,
    unpermute_rotary_rows,
)
from engine.worker.quantized_weight import QuantizedTensor

__all__ = [  # hf_tensor_name and unpermute_rotary_rows: for callers of this module
    "GgufCheckpoint",
    "GgufIndex",
    "GgufTensor",
    "gguf_architecture",
    "hf_tensor_name",
    "unpermute_rotary_rows",
]


def gguf_architecture(header: GgufHeader) -> str:
    """The file's `general.architecture`, checked against GGUF_ARCHITECTURES."""
    arch = header.value("general.architecture", str)
    if arch not in GGUF_ARCHITECTURES:
        why = f": {REFUSED[arch]}" if arch in REFUSED else ""
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported ({header.name}){why}; pagedserve "
            f"loads GGUF files of {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


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

    architecture: str  # general.architecture
    num_heads: int
    num_kv_heads: int
    num_experts: int  # 0: a dense model
    tensors: tuple[GgufTensor, ...]

    @classmethod
    def read(cls, path: str | Path) -> GgufIndex:
        """Parses the header with the `gguf` package; checks the architecture. A file it
        cannot read raises ValueError naming the file (gguf_header.py)."""
        return cls.from_header(GgufHeader(path))

    @classmethod
    def from_header(cls, header: GgufHeader) -> GgufIndex:
        arch = gguf_architecture(header)
        num_heads = header.value(f"{arch}.attention.head_count", int)
        num_kv = header.value(f"{arch}.attention.head_count_kv", int, required=False)
        num_experts = header.value(f"{arch}.expert_count", int, required=False) or 0
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
        num_kv = num_kv if num_kv is not None else num_heads
        return cls(arch, num_heads, num_kv, num_experts, tensors)

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "num_experts": self.num_experts,
            "tensors": [[t.name, t.qtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
        }

    @classmethod
    def from_json(cls, data: dict) -> GgufIndex:
        tensors = tuple(
            GgufTensor(name, qtype, tuple(shape), offset, nbytes)
            for name, qtype, shape, offset, nbytes in data["tensors"]
        )
        return cls(
            data["architecture"],
            data["num_heads"],
            data["num_kv_heads"],
            data["num_experts"],
            tensors,
        )

    @property
    def family(self) -> str:
        """Its gguf_names.FAMILIES key: the architecture, or "mixtral" for a `llama`
        file with experts."""
        return family_name(self.architecture, self.num_experts)

    @property
    def hf_architecture(self) -> str:
        return FAMILIES[self.family].hf_architecture

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]


class GgufCheckpoint:
    """One GGUF file, memory-mapped; `tensors(dtype)` dequantizes one tensor at a time."""

    def __init__(self, path: str | Path, index: GgufIndex) -> None:
        self.path = Path(path)
        self.index = index

    def tensors(
        self, dtype: torch.dtype, keep_blocks: frozenset[int] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(hf_name, tensor in `dtype`) for every tensor the HF model holds (each
        expert's apart, as the HF checkpoint stores them). A matrix whose type is in
        `keep_blocks` (ggml type ids) comes as a `QuantizedTensor` in its own blocks."""
        index = self.index
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        for entry in index.tensors:
            if entry.qtype in keep_blocks and len(entry.shape) >= 2:
                yield from self._blocks(entry)
                continue
            data = raw[entry.offset : entry.offset + entry.nbytes]
            values = torch.from_numpy(_dequantize(entry, data))  # [(experts,) rows, cols]
            for name, tensor in hf_tensors(
                index.family, entry.name, values, index.num_heads, index.num_kv_heads
            ):
                yield name, tensor.to(dtype)

    def _blocks(self, entry: GgufTensor) -> Iterator[tuple[str, QuantizedTensor]]:
        """The tensor's rows in their blocks, through the same row operations as the
        float path (q/k permutation undone, experts split). Read from the file, not the
        map: mapped pages would count in the resident memory beside the model's copy."""
        qtype, k = QuantType(entry.qtype), entry.shape[-1]
        data = np.fromfile(self.path, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        blocks = torch.from_numpy(data).view(*entry.shape[:-1], row_bytes(qtype, k))
        index = self.index
        for name, rows in hf_tensors(
            index.family, entry.name, blocks, index.num_heads, index.num_kv_heads
        ):
            yield name, QuantizedTensor(rows.contiguous(), qtype, k)


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
