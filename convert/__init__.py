"""Upcycle transformers checkpoints (Mixtral, Qwen2/3-MoE, OLMoE, Llama, Mistral, Qwen2/3) into Dual-Flow ones."""

from .converter import convert_checkpoint
from .families import SUPPORTED_MODEL_TYPES


__all__ = ["SUPPORTED_MODEL_TYPES", "convert_checkpoint"]
