"""Writes GGUF files for tests from a Hugging Face directory, the way llama.cpp's
converter (convert_hf_to_gguf.py) lays them out, plus the HF "twin" holding exactly the
weights the GGUF decodes to, so the two must generate the same tokens; and a minimal GGUF
of a few hundred bytes (header checks). Needs no torch until a twin is written.

Per llama.cpp architecture, as its converter does: names from the `gguf` package's own
map (`gguf.get_tensor_name_map`), q/k rows permuted for Llama (and Mixtral, written as
`llama`), Gemma's norms stored as w + 1 (lm_head dropped: tied), Phi-3's longrope factors
as tensors, experts stacked [n_expert, ...] (`ffn_gate_exps`), GPT-OSS's interleaved
gate_up split in two and transposed; the router and 1-D tensors kept F32, the rest
quantized to one type (a row that does not fill the type's blocks stays F32).

The twin undoes each step on the decoded tensors (`Converted.inverse`), so with F32 it
equals the HF checkpoint (Gemma's norms up to the rounding of (w + 1) - 1).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GEMMA = ("gemma2", "gemma3")
PERMUTED = ("llama", "mistral")  # llama.cpp's LlamaModel permutes q/k rows
# HF's per-expert names: model.layers.L.(mlp|block_sparse_moe).experts.E.(w1|gate_proj...)
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.\w+)\.experts\.(\d+)\.(\w+)\.weight")
_LLAMA_NAMES = {
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

Decoded = dict[str, np.ndarray]  # GGUF name -> the float32 values the file decodes to


@dataclass
class Converted:
    """llama.cpp's tensors for one checkpoint: `tensors` (GGUF name -> float32 array in
    the file's layout, before quantization) and `inverse` (HF name -> its value rebuilt
    from the decoded tensors)."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    inverse: dict[str, Callable[[Decoded], np.ndarray]] = field(default_factory=dict)

    def same(self, hf_name: str, gguf_name: str, values: np.ndarray) -> None:
        self.tensors[gguf_name] = values
        self.inverse[hf_name] = lambda d: d[gguf_name]


def gguf_name(hf_name: str) -> str:
    """A Llama checkpoint's tensor name in llama.cpp's files."""
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_LLAMA_NAMES[part]}.{kind}"
    return f"{_LLAMA_NAMES[stem]}.{kind}"


def permute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def convert(arch: str, config: dict, weights: dict[str, np.ndarray]) -> Converted:
    """What llama.cpp's converter writes for the HF `weights` (float32) of `arch`."""
    import gguf

    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])

    def name_of(hf_name: str) -> str:
        mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise KeyError(f"llama.cpp has no {arch} name for {hf_name}")
        return mapped

    out = Converted()
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        if arch in GEMMA and name == "lm_head.weight":
            continue  # tied; the converter skips it
        if m := _PER_EXPERT.fullmatch(name):
            block, e, proj = m.groups()
            experts.setdefault((block, proj), {})[int(e)] = w
        elif arch == "gpt-oss" and ".experts." in name:
            _gpt_oss_experts(out, name, w, name_of)
        elif arch in GEMMA and name.endswith("norm.weight"):
            target = name_of(name)
            out.tensors[target] = w + np.float32(1)  # Gemma's RMSNorm scales by (1 + w)
            out.inverse[name] = lambda d, t=target: d[t] - np.float32(1)
        elif arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_key_value_heads" if "k_proj" in name else "num_attention_heads"]
            target = name_of(name)
            out.tensors[target] = permute_rotary_rows(w, heads)
            out.inverse[name] = lambda d, t=target, h=heads: _unpermute(d[t], h)
        else:
            suffix = ".weight" if name.endswith(".sinks") else ""  # attn_sinks.weight
            out.same(name, name_of(name + suffix), w)
    for (block, proj), per_expert in experts.items():
        target = name_of(f"{block}.experts.{proj}") + ".weight"  # [n_expert, rows, cols]
        out.tensors[target] = np.stack([per_expert[e] for e in sorted(per_expert)])
        for e in per_expert:
            out.inverse[f"{block}.experts.{e}.{proj}.weight"] = lambda d, t=target, e=e: d[t][e]
    if arch == "phi3":  # longrope's factors: tensors, not metadata
        rope = config.get("rope_parameters") or {}
        for which in ("long", "short"):
            if f"{which}_factor" in rope:
                values = np.array(rope[f"{which}_factor"], dtype=np.float32)
                out.tensors[f"rope_factors_{which}.weight"] = values
    return out


def _gpt_oss_experts(out: Converted, name: str, w: np.ndarray, name_of) -> None:
    """GPT-OSS's stacked experts (GptOssModel.modify_tensors): gate_up_proj [E, H, 2I],
    gate and up interleaved, becomes ffn_gate_exps and ffn_up_exps [E, I, H]; down_proj
    [E, I, H] becomes ffn_down_exps [E, H, I]; the biases split likewise."""
    stem = name.rpartition(".experts.")[0] + ".experts"
    gate, up, down = (name_of(f"{stem}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
    if name.endswith("gate_up_proj"):
        rows = np.ascontiguousarray(w.transpose(0, 2, 1))  # [E, 2I, H]
        out.tensors[gate + ".weight"], out.tensors[up + ".weight"] = rows[:, ::2], rows[:, 1::2]
        out.inverse[name] = lambda d: _interleave(
            d[gate + ".weight"], d[up + ".weight"], axis=1
        ).transpose(0, 2, 1)
    elif name.endswith("gate_up_proj_bias"):
        out.tensors[gate + ".bias"], out.tensors[up + ".bias"] = w[:, ::2], w[:, 1::2]
        out.inverse[name] = lambda d: _interleave(d[gate + ".bias"], d[up + ".bias"], axis=1)
    elif name.endswith("down_proj"):
        out.tensors[down + ".weight"] = np.ascontiguousarray(w.transpose(0, 2, 1))
        out.inverse[name] = lambda d: d[down + ".weight"].transpose(0, 2, 1)
    else:  # down_proj_bias [E, H]
        out.same(name, down + ".bias", w)


def _interleave(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
    """a[..., 0], b[..., 0], a[..., 1], ... along `axis`."""
    stacked = np.stack([a, b], axis=axis + 1)
    shape = list(a.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def write_gguf_and_twin(
    hf_dir: Path, gguf_path: Path, twin_dir: Path, qtype, arch="llama", expert_qtype=None
) -> None:
    """GGUF of `hf_dir` as llama.cpp's `arch` with every weight whose rows fit the type's
    blocks stored as `qtype` (the experts' as `expert_qtype`, by default `qtype`; 1-D
    tensors and the router F32, as llama.cpp does), and `twin_dir`: `hf_dir` with the
    weights the GGUF decodes to."""
    import gguf
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    converted = convert(arch, config, {k: v.float().numpy() for k, v in weights.items()})
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    _write_config(writer, arch, config)
    _write_tokenizer(writer, hf_dir)
    decoded = {}
    for name, values in converted.tensors.items():
        kind = expert_qtype if expert_qtype is not None and "_exps." in name else qtype
        if values.ndim < 2 or ".ffn_gate_inp." in name:
            kind = gguf.GGMLQuantizationType.F32
        (stored, stored_type), decoded[name] = _encode(values, kind)
        writer.add_tensor(name, stored, raw_dtype=stored_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    twin = {
        name: torch.from_numpy(np.ascontiguousarray(rebuild(decoded)))
        for name, rebuild in converted.inverse.items()
    }
    shutil.copytree(hf_dir, twin_dir)
    save_file(twin, str(twin_dir / "model.safetensors"))


def byte_vocab_checkpoint(name: str, directory: Path, seed: int = 3) -> Path:
    """A tiny random `name` checkpoint (tiny_models.ARCHITECTURES) over the built-in
    byte-level tokenizer's 258 tokens (bos 256, eos 257), as `write_gguf_and_twin` takes."""
    from engine.worker.builtin_model import builtin_model_dir
    from tests.engine.tiny_models import save_hf_model

    save_hf_model(name, directory, seed=seed, vocab_size=258)
    config = json.loads((directory / "config.json").read_text())
    config.update(bos_token_id=256, eos_token_id=257)
    (directory / "config.json").write_text(json.dumps(config))
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(builtin_model_dir() / file, directory / file)
    return directory


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
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32 or values.ndim < 2 or values.shape[-1] % block:
        return (values, GGMLQuantizationType.F32), values
    if qtype == GGMLQuantizationType.F16:
        half = values.astype(np.float16)
        return (half, qtype), half.astype(np.float32)
    packed = quants.quantize(values, qtype)
    return (packed, qtype), quants.dequantize(packed, qtype).reshape(values.shape)


def _write_config(writer, arch: str, config: dict) -> None:
    """The metadata llama.cpp's converter writes for `arch` (its set_gguf_parameters)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)  # Gemma 3 nests them by layer type
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch != "gemma2":  # Gemma2Model writes no rotary base (llama.cpp's default: 10000)
        theta = full.get("rope_theta") or config.get("rope_theta")
        writer.add_rope_freq_base(float(theta or 10000.0))
    if experts := config.get("num_local_experts") or config.get("num_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch in PERMUTED or arch in ("qwen2", "qwen3"):
        writer.add_rope_dimension_count(head_dim)
    elif arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    elif arch == "gemma3":
        _write_gemma3(writer, config, rope, full)
    elif arch == "phi3":
        _write_phi3(writer, config, rope, heads)
    elif arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    elif arch == "gpt-oss":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_rope_scaling_type(_rope_type("yarn"))
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _write_gemma3(writer, config: dict, rope: dict, full: dict) -> None:
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(_rope_type("linear"))
        writer.add_rope_scaling_factor(full["factor"])


def _write_phi3(writer, config: dict, rope: dict, heads: int) -> None:
    """Phi3MiniModel: the rotary width in dimensions, the window (0: none), and for
    longrope the original context and the cos/sin scale (the factors are tensors)."""
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // heads)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    original = rope.get("original_max_position_embeddings")
    original = original or config.get("original_max_position_embeddings")
    writer.add_rope_scaling_orig_ctx_len(original or config["max_position_embeddings"])
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / original
        attn = np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(float(attn))


def _rope_type(name: str):
    from gguf import RopeScalingType

    return RopeScalingType(name)


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


def own_cache_sharing_built_kernels(tmp_path: Path, monkeypatch) -> None:
    """Points PAGEDSERVE_CACHE_DIR at a cache of the test's own (side-cars land there)
    that shares the native kernels already built (an empty cache would build them again,
    for minutes)."""
    from cuda_ext.build import cache_root

    built = cache_root() / "torch_extensions"
    built.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "torch_extensions").symlink_to(built, target_is_directory=True)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(cache))
