"""Dual-Flow Transformer for transformers: config, model and cache (the files that ship as remote code)."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_dualflow import DualFlowCache
from .configuration_dualflow import DualFlowConfig
from .modeling_dualflow import DualFlowForCausalLM, DualFlowModel, DualFlowPreTrainedModel


AutoConfig.register("dualflow", DualFlowConfig, exist_ok=True)
AutoModel.register(DualFlowConfig, DualFlowModel, exist_ok=True)
AutoModelForCausalLM.register(DualFlowConfig, DualFlowForCausalLM, exist_ok=True)

# save_pretrained then writes `auto_map` and copies the code files, so the folder loads with
# trust_remote_code.
DualFlowConfig.register_for_auto_class()
DualFlowModel.register_for_auto_class("AutoModel")
DualFlowForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# What `save_pretrained` copies next to the weights so the folder loads with trust_remote_code.
REMOTE_CODE_FILES = (
    "configuration_dualflow.py",
    "modeling_dualflow.py",
    "attention_dualflow.py",
    "outputs_dualflow.py",
    "cache_dualflow.py",
)

__all__ = [
    "DualFlowCache",
    "DualFlowConfig",
    "DualFlowForCausalLM",
    "DualFlowModel",
    "DualFlowPreTrainedModel",
]
