"""Maps HF `architectures` names to our model classes."""

from __future__ import annotations

from engine.worker.models.base import CausalLM
from engine.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.worker.models.gpt2 import GPT2LMHeadModel
from engine.worker.models.gpt_oss import GptOssForCausalLM
from engine.worker.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from engine.worker.models.mixtral import MixtralForCausalLM, Qwen3MoeForCausalLM
from engine.worker.models.opt import OPTForCausalLM
from engine.worker.models.phi3 import Phi3ForCausalLM
from engine.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from engine.worker.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "OPTForCausalLM": OPTForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}

# Architectures refused with what to do instead.
REFUSED: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": (
        "multimodal Qwen 3.5 checkpoints (a vision tower, the text model's config under "
        "text_config and its weights under model.language_model.) are not supported; "
        "serve a text-only Qwen3_5ForCausalLM checkpoint"
    ),
}


def resolve_model_class(architecture: str) -> type[CausalLM]:
    if architecture in REFUSED:
        raise ValueError(f"architecture {architecture!r}: {REFUSED[architecture]}")
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]
