"""Tools around the Dual-Flow model: checkpoint conversion, fine-tuning, sharing, measurement (CLI `dualflow`)."""

from modeling_dualflow import DualFlowCache, DualFlowConfig, DualFlowForCausalLM, DualFlowModel


__all__ = ["DualFlowCache", "DualFlowConfig", "DualFlowForCausalLM", "DualFlowModel"]
