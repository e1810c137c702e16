"""Upcycle transformers checkpoints (Mixtral, Qwen2/3-MoE, OLMoE, Llama, Mistral, Qwen2/3) into Dual-Flow ones."""

import importlib

from .families import SUPPORTED_MODEL_TYPES


__all__ = ["DTYPE_NAMES", "SUPPORTED_MODEL_TYPES", "convert_checkpoint"]
# The output dtypes of a conversion: "auto" keeps each tensor's own.
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def __getattr__(name: str):
    # The converter loads torch: only on first use, so that `dualflow convert --help` stays instant.
    if name == "convert_checkpoint":
        return importlib.import_module(".converter", __name__).convert_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
