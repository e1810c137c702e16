"""Upcycle transformers checkpoints (Mixtral, Qwen2/3-MoE, OLMoE, Llama, Mistral, Qwen2/3) into Dual-Flow ones."""

import importlib

from .families import SUPPORTED_MODEL_TYPES


__all__ = ["DTYPE_NAMES", "SUPPORTED_MODEL_TYPES", "convert_checkpoint", "init_aux_from_primary"]
# The output dtypes of a conversion: "auto" keeps each tensor's own.
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def __getattr__(name: str):
    # The converter loads torch: only on first use, so that `dualflow convert --help` stays instant.
    if name == "convert_checkpoint":
        return importlib.import_module(".converter", __name__).convert_checkpoint
    if name == "init_aux_from_primary":
        return importlib.import_module(".engine", __name__).init_aux_from_primary
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
