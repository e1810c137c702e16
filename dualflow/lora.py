"""
LoRA for Dual-Flow models with PEFT: low-rank adapters on the shared weights, the aux flow's own modules (token
embedding, per-layer couplings, round gates and aux adapters) trained in full through `modules_to_save`. Plain PEFT saves, reloads and merges
the result (`PeftModel.save_pretrained`, `PeftModel.from_pretrained`, `merge_and_unload`).
"""

import warnings

from peft import LoraConfig, PeftModel, get_peft_model

import modeling_dualflow  # noqa: F401  (registers the dualflow model type with the Auto classes)


ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# nn.Linear MLPs: the dense layers, `mlp_only_layers` and the shared expert.
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
# Routed experts are stored fused as parameters, which `target_modules` cannot reach.
FUSED_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# The aux flow's own modules; those a config does not build (round gates, adapters) match nothing: PEFT skips them.
AUX_MODULES = [
    "aux_embed_tokens",
    "aux_coupling",
    "aux_round_gate",
    "aux_q_adapter",
    "aux_o_adapter",
    "aux_mlp_adapter",
]


def dualflow_lora_config(
    config,
    r: int = 16,
    lora_alpha: int = 32,
    train_aux_modules: bool = True,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
) -> LoraConfig:
    """
    LoRA on attention, MLP and (MoE) fused expert weights, or on the `target_modules` given (module names; the fused
    experts then only if "experts" is among them); the aux flow's own modules are trained in full unless
    `train_aux_modules` is False (LoRA on a model served as a single flow).
    """
    experts = config.num_experts and (target_modules is None or "experts" in target_modules)
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=ATTENTION_PROJECTIONS + MLP_PROJECTIONS
        if target_modules is None
        else [name for name in target_modules if name != "experts"],
        target_parameters=FUSED_EXPERT_PARAMETERS if experts else None,
        modules_to_save=AUX_MODULES if train_aux_modules else None,
        task_type="CAUSAL_LM",
    )


def add_lora(model, r: int = 16, lora_alpha: int = 32, train_aux_modules: bool = True, **options) -> PeftModel:
    """Wrap `model` with LoRA as configured by `dualflow_lora_config` (`options`: its `lora_dropout`, `target_modules`)."""
    with warnings.catch_warnings():
        # PEFT reads `is_gradient_checkpointing`, a name transformers 5.23 deprecated: PEFT's to change, not the user's
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, dualflow_lora_config(model.config, r, lora_alpha, train_aux_modules, **options))
