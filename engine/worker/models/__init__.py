"""Model definitions: our own code, loading Hugging Face checkpoints by parameter name."""

from engine.worker.models.registry import MODEL_REGISTRY, resolve_model_class

__all__ = ["MODEL_REGISTRY", "resolve_model_class"]
