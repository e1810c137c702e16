"""
LoRA for Dual-Flow models with PEFT: low-rank adapters on the shared weights, the aux flow's own parameters fully
trained.

PEFT's `modules_to_save` only holds modules. The aux embedding is an `nn.Embedding` and goes there; the per-layer
couplings `aux_coupling` are bare `nn.Parameter`s of the decoder layers (and `target_parameters` only takes 2-d/3-d
weights), so they are trained in place on the base model and stored next to the adapter in `aux_coupling.safetensors`.
Use `save_lora` / `load_lora` (not `PeftModel.save_pretrained` / `from_pretrained` alone) so they travel with it.
"""

from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from .errors import DualFlowUserError


AUX_COUPLING_FILE = "aux_coupling.safetensors"
ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# nn.Linear MLPs: the dense layers, `mlp_only_layers` and the shared expert.
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
# Routed experts are stored fused as parameters, which `target_modules` cannot reach.
FUSED_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def dualflow_lora_config(config, r: int = 16, lora_alpha: int = 32) -> LoraConfig:
    """LoRA on attention, MLP and (MoE) fused expert weights; the aux embedding is trained in full."""
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
        target_parameters=FUSED_EXPERT_PARAMETERS if config.num_experts else None,
        modules_to_save=["aux_embed_tokens"],
        task_type="CAUSAL_LM",
    )


def _couplings(model) -> dict:
    """Base-model parameter name -> coupling parameter (`model` may be a PeftModel or the base model)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return {name: parameter for name, parameter in base.named_parameters() if name.endswith("aux_coupling")}


def add_lora(model, r: int = 16, lora_alpha: int = 32, lora_config: LoraConfig | None = None) -> PeftModel:
    """Wrap `model` with LoRA (`dualflow_lora_config` unless `lora_config` is given) and make the couplings trainable."""
    peft_model = get_peft_model(model, lora_config or dualflow_lora_config(model.config, r, lora_alpha))
    for parameter in _couplings(peft_model).values():
        parameter.requires_grad_(True)
    return peft_model


def save_lora(peft_model: PeftModel, save_directory) -> None:
    """Save the adapter (LoRA weights + aux embedding) and the trained couplings into `save_directory`."""
    peft_model.save_pretrained(save_directory)
    couplings = {name: parameter.detach().contiguous() for name, parameter in _couplings(peft_model).items()}
    save_file(couplings, str(Path(save_directory) / AUX_COUPLING_FILE))


def load_lora(base_model, adapter_directory, is_trainable: bool = False) -> PeftModel:
    """Load an adapter saved by `save_lora` onto a fresh base model (its couplings are overwritten in place)."""
    coupling_path = Path(adapter_directory) / AUX_COUPLING_FILE
    if not coupling_path.is_file():
        raise DualFlowUserError(f"{adapter_directory} has no {AUX_COUPLING_FILE}: save the adapter with save_lora")
    saved = load_file(str(coupling_path))
    couplings = _couplings(base_model)
    if saved.keys() != couplings.keys():
        raise DualFlowUserError(
            f"{coupling_path} holds couplings for {len(saved)} layers, the base model has {len(couplings)}"
        )
    for name, parameter in couplings.items():
        parameter.data.copy_(saved[name])
    peft_model = PeftModel.from_pretrained(base_model, adapter_directory, is_trainable=is_trainable)
    for parameter in couplings.values():
        parameter.requires_grad_(is_trainable)
    return peft_model
