"""
LoRA for Dual-Flow models with PEFT: low-rank adapters on the shared weights, the aux flow's own modules (token
embedding, per-layer couplings, round gates and aux adapters) trained in full through `modules_to_save`. Plain PEFT saves, reloads and merges
the result (`PeftModel.save_pretrained`, `PeftModel.from_pretrained`, `merge_and_unload`). QLoRA: LoRA on a
model loaded in 4 bits (`qlora_quantization_config`).
"""

import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig

import modeling_dualflow  # noqa: F401  (registers the dualflow model type with the Auto classes)


ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# nn.Linear MLPs: the dense layers, `mlp_only_layers` and the shared expert.
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
# Routed experts are stored fused as parameters, which `target_modules` cannot reach (PEFT's "all-linear"
# reaches them for Qwen3-MoE only, through a table of transformers' model types).
FUSED_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# gate_up_proj holds two projections: twice the rank and alpha (one rank-r LoRA each), as PEFT does for Qwen3-MoE.
# PEFT checks rank and alpha pattern keys against the modules it adapted, not the parameters, so a key naming
# gate_up_proj would be reported as ignored (though applied) on every load: the config's r and lora_alpha are
# gate_up_proj's, and this key, which every other target's name matches, gives the others r and alpha.
NOT_GATE_UP_PROJ = r"(?!.*gate_up_proj$).*"
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
        r=2 * r if experts else r,
        lora_alpha=2 * lora_alpha if experts else lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=ATTENTION_PROJECTIONS + MLP_PROJECTIONS
        if target_modules is None
        else [name for name in target_modules if name != "experts"],
        target_parameters=FUSED_EXPERT_PARAMETERS + ["mlp.gate.weight"] if experts else None,
        rank_pattern={NOT_GATE_UP_PROJ: r} if experts else {},
        alpha_pattern={NOT_GATE_UP_PROJ: lora_alpha} if experts else {},
        modules_to_save=AUX_MODULES if train_aux_modules else None,
        task_type="CAUSAL_LM",
    )


def projection_rank(adapter_config: dict) -> tuple[int, int]:
    """The rank and alpha per projection of an adapter config (PEFT's dict): those given to `dualflow_lora_config`."""
    r, lora_alpha = adapter_config["r"], adapter_config["lora_alpha"]
    rank_pattern, alpha_pattern = adapter_config["rank_pattern"] or {}, adapter_config["alpha_pattern"] or {}
    return rank_pattern.get(NOT_GATE_UP_PROJ, r), alpha_pattern.get(NOT_GATE_UP_PROJ, lora_alpha)


def qlora_quantization_config(compute_dtype: torch.dtype = torch.float32) -> BitsAndBytesConfig:
    """
    QLoRA's 4-bit weights (`from_pretrained(..., quantization_config=...)`): NF4 with double quantisation,
    computing in `compute_dtype`. bitsandbytes quantises the nn.Linear layers but lm_head: the fused experts, the
    router and the aux flow's own modules stay in the dtype loaded.
    """
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def add_lora(model, r: int = 16, lora_alpha: int = 32, train_aux_modules: bool = True, **options) -> PeftModel:
    """
    Wrap `model` with LoRA as configured by `dualflow_lora_config` (`options`: its `lora_dropout`,
    `target_modules`). A model loaded in 4 or 8 bits is first prepared for training as PEFT does
    (`prepare_model_for_kbit_training`: frozen, activation checkpointing on, the non-reentrant kind torch
    recommends).
    """
    with warnings.catch_warnings():
        # PEFT calls `is_gradient_checkpointing` and `gradient_checkpointing_enable`, names transformers 5.23
        # deprecated: PEFT's to change, not the user's
        for name in ("is_gradient_checkpointing", "gradient_checkpointing_enable"):
            warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)
        # PEFT checks rank and alpha patterns against modules only: with the experts as the only targets, the
        # pattern for their down_proj and the router matches no module, though it applies to them
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match")
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            checkpointing = {"use_reentrant": False}
            model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs=checkpointing)
        return get_peft_model(model, dualflow_lora_config(model.config, r, lora_alpha, train_aux_modules, **options))
