"""A GGUF file's metadata as an ordinary Hugging Face directory (its "side-car").

The config, tokenizer, special tokens and chat template of a GGUF file live in its
metadata. Turning them into transformers objects takes seconds (the 49k-entry vocabulary
and merges are parsed field by field), and every process of a served engine needs them,
so `gguf_sidecar_dir(path)` does it once and writes the result where the rest of
pagedserve expects a model: a directory with config.json (with `architectures`),
generation_config.json and the tokenizer files. The weights stay in the GGUF file
(`weights.gguf.json` names it and holds its tensor index) and are read by
`GgufCheckpoint`.

The directory is keyed by the file's absolute path, size and modification time, and is
written atomically, so a changed file gets a new side-car and a concurrent start never
sees a half-written one.

transformers' GGUF reading leaves out some fields our model classes need, or leaves them
at its config class's default (one checkpoint's value); `completed_config` sets them
from the metadata as llama.cpp reads the file (comments below say which and why).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.worker.cache_files import write_once
from engine.worker.gguf_checkpoint import GgufCheckpoint, GgufIndex
from engine.worker.gguf_header import GgufHeader

POINTER_FILE = "weights.gguf.json"  # {"gguf": "/abs/path/model.gguf", "index": GgufIndex}
SIDECAR_VERSION = 2  # bump when the files written below change


def is_gguf_file(model: str) -> bool:
    return model.endswith(".gguf") and Path(model).expanduser().is_file()


def gguf_sidecar_dir(path: str | Path, cache_dir: Path) -> Path:
    """The side-car directory of the GGUF file at `path`, written on first use."""
    gguf_path = Path(path).expanduser().resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{SIDECAR_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{digest}"
    return write_once(target, POINTER_FILE, lambda scratch: write_sidecar(gguf_path, scratch))


def gguf_weights(model_dir: str | Path) -> GgufCheckpoint | None:
    """The GGUF checkpoint a side-car directory points at; None for an ordinary one."""
    pointer = Path(model_dir) / POINTER_FILE
    if not pointer.is_file():
        return None
    data = json.loads(pointer.read_text())
    return GgufCheckpoint(data["gguf"], GgufIndex.from_json(data["index"]))


def write_sidecar(gguf_path: Path, directory: Path) -> None:
    """config.json, generation_config.json, tokenizer files and the pointer file."""
    from transformers import AutoConfig, AutoTokenizer

    header = GgufHeader(gguf_path)
    index = GgufIndex.from_header(header)  # checks the file and the architecture first
    where, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except Exception as exc:  # noqa: BLE001 - metadata transformers cannot take: name the file
        raise ValueError(
            f"GGUF file {name}: its config or tokenizer metadata cannot be read "
            f"({type(exc).__name__}: {exc}); download or convert it again"
        ) from exc
    config = completed_config(config, header, index)
    config.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    eos = getattr(config, "eos_token_id", None)
    generation = {"eos_token_id": eos} if eos is not None else {}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    pointer = {"gguf": str(gguf_path), "index": index.to_json()}
    (directory / POINTER_FILE).write_text(json.dumps(pointer))


class Metadata:
    """The file's `{architecture}.{key}` values: `meta(key, kind)`, None when absent
    unless `required` (then a ValueError naming the file and the key)."""

    def __init__(self, header: GgufHeader, architecture: str) -> None:
        self.header, self.architecture = header, architecture

    def __call__(self, key: str, kind: type, required: bool = False) -> Any:
        return self.header.value(f"{self.architecture}.{key}", kind, required=required)


def completed_config(config, header: GgufHeader, index: GgufIndex):
    """transformers' `config` with `architectures`, tied embeddings and the fields
    `_FILLS` reads for the file's family set: a new config (of another class where a fill
    sets `model_type`), rebuilt so transformers checks them."""
    from transformers import AutoConfig

    fields = {
        "architectures": [index.hf_architecture],
        # llama.cpp writes `output` only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in index.tensor_names(),
    }
    if fill := _FILLS.get(index.family):
        fields.update(fill(Metadata(header, index.architecture), config, index))
    data = {**config.to_dict(), **fields}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _gemma2(meta: Metadata, config, index: GgufIndex) -> dict:
    """transformers reads neither soft cap (it keeps Gemma2Config's 50 and 30, which
    llama.cpp also assumes when a key is absent) nor the score scale."""
    fields = {
        "query_pre_attn_scalar": _gemma_query_scale(config, layers_of_27b=46),
        "layer_types": _layer_types(config.num_hidden_layers, full_every=2),
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (cap := meta(key, float)) is not None:
            fields[key] = cap
    return fields


def _gemma3(meta: Metadata, config, index: GgufIndex) -> dict:
    """transformers reads one rotary base and no scaling, where Gemma 3 has one rotary
    per layer type: global layers `rope.freq_base` (scaled by `rope.scaling.*`), local
    ones `rope.freq_base_swa` (llama.cpp: 10000); nor the final soft cap, nor the score
    scale. A file without a window has full attention on every layer, as in llama.cpp."""
    full = {"rope_type": "default", "rope_theta": meta("rope.freq_base", float) or 1e6}
    scaling = meta("rope.scaling.type", str)
    if scaling == "linear":
        full.update(rope_type="linear", factor=meta("rope.scaling.factor", float, required=True))
    elif scaling not in (None, "none"):
        raise ValueError(
            f"GGUF file {meta.header.name}: gemma3 rope scaling {scaling!r} is not "
            "supported (Gemma 3 uses linear)"
        )
    local = {"rope_type": "default", "rope_theta": meta("rope.freq_base_swa", float) or 1e4}
    window = meta("attention.sliding_window", int)
    return {
        "query_pre_attn_scalar": _gemma_query_scale(config, layers_of_27b=62),
        "final_logit_softcapping": meta("final_logit_softcapping", float),
        "rope_parameters": {"sliding_attention": local, "full_attention": full},
        "layer_types": _layer_types(config.num_hidden_layers, full_every=6 if window else 1),
    }


def _gemma_query_scale(config, layers_of_27b: int) -> int:
    """No key holds it: llama.cpp scales scores by head_dim ** -0.5, and for the 27B
    models (told apart by their layer count) by (hidden / heads) ** -0.5, as Google's
    reference does; transformers keeps its config class's 256."""
    if config.num_hidden_layers == layers_of_27b:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim


def _layer_types(num_layers: int, full_every: int) -> list[str]:
    """llama.cpp's fixed pattern (set_swa_pattern): every `full_every`-th layer full, the
    others sliding-window (Gemma 2: every 2nd, Gemma 3: every 6th)."""
    return [
        "full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _phi3(meta: Metadata, config, index: GgufIndex) -> dict:
    """transformers reads neither the window, nor the rotary width (`rope.dimension_count`,
    partial in Phi-4-mini), nor longrope: its factors are tensors (`rope_factors_long`,
    `rope_factors_short`), its original context `rope.scaling.original_context_length`.
    (`rope.scaling.attn_factor` is left out: transformers derives the same cos/sin scale
    from the two context lengths, as llama.cpp's converter did.)"""
    head_dim = config.hidden_size // config.num_attention_heads
    rope = {
        "rope_type": "default",
        "rope_theta": config.rope_parameters["rope_theta"],
        "partial_rotary_factor": (meta("rope.dimension_count", int) or head_dim) / head_dim,
    }
    factors = {
        f"{which}_factor": _tensor_values(meta.header, f"rope_factors_{which}.weight")
        for which in ("long", "short")
    }
    original = meta("rope.scaling.original_context_length", int)
    if all(values is not None for values in factors.values()):
        original = meta("rope.scaling.original_context_length", int, required=True)
        rope.update(factors, rope_type="longrope", original_max_position_embeddings=original)
    window = meta("attention.sliding_window", int)
    fields = {"rope_parameters": rope, "sliding_window": window or None}  # 0: none (Phi-4)
    if original is not None:
        fields["original_max_position_embeddings"] = original
    return fields


def _tensor_values(header: GgufHeader, name: str) -> list[float] | None:
    tensor = next((t for t in header.tensors if t.name == name), None)
    return None if tensor is None else [float(v) for v in tensor.data]


def _qwen3moe(meta: Metadata, config, index: GgufIndex) -> dict:
    """transformers reads `feed_forward_length` (the dense MLP's, which llama.cpp's
    qwen3moe has none of), not the experts' width; llama.cpp puts experts on every layer."""
    return {
        "moe_intermediate_size": meta("expert_feed_forward_length", int, required=True),
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
    }


def _mixtral(meta: Metadata, config, index: GgufIndex) -> dict:
    """transformers reads a `llama` file as Llama: a Mixtral config, the experts' count
    and top-k."""
    return {
        "model_type": "mixtral",
        "num_local_experts": index.num_experts,
        "num_experts_per_tok": meta("expert_used_count", int, required=True),
    }


_FILLS: dict[str, Callable[[Metadata, Any, GgufIndex], dict]] = {
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "qwen3moe": _qwen3moe,
    "mixtral": _mixtral,
}
