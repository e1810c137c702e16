"""Tools around the Dual-Flow model: checkpoint conversion, fine-tuning, sharing, measurement (CLI `dualflow`)."""

import importlib


__all__ = ["DualFlowCache", "DualFlowConfig", "DualFlowForCausalLM", "DualFlowModel"]


def __getattr__(name: str):
    # The model classes load torch and transformers: only on first use, so that `dualflow --help` stays instant.
    if name in __all__:
        return getattr(importlib.import_module("modeling_dualflow"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
