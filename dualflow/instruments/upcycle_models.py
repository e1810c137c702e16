"""
The models of the upcycling regime: the pretrained base saved as transformers' Qwen3-MoE (the checkpoint the real
converter reads), and the model each recipe continues from a converted folder, with exactly its parameters trainable.
"""

import copy
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM

from ..aux_training import freeze_aux_flow, freeze_for_aux_training
from ..lora import add_lora
from .upcycle_recipes import ADAPTER_RANK, Recipe


def adapter_budget_lora_rank(folder: Path) -> int:
    """The LoRA rank on the single-flow model of `folder` whose trainable parameters come closest to the aux-adapter
    recipe's (aux embedding, couplings and rank-`ADAPTER_RANK` adapters); LoRA's count is linear in the rank."""
    config = DualFlowConfig.from_pretrained(folder)
    budget = freeze_for_aux_training(
        DualFlowForCausalLM(DualFlowConfig.from_pretrained(folder, aux_adapter_rank=ADAPTER_RANK))
    ).num_parameters(only_trainable=True)
    per_rank = add_lora(DualFlowForCausalLM(config), r=1, train_aux_modules=False).num_parameters(only_trainable=True)
    return max(1, round(budget / per_rank))


def depth_upscaled(model: DualFlowForCausalLM, factor: int) -> DualFlowForCausalLM:
    """
    Depth up-scaling: a model with `factor` x the layers, layer i of `model` repeated in place as layers
    factor * i ... factor * i + factor - 1, every other weight copied as it is. It does not compute as
    `model` (each layer's update is applied `factor` times); continued training starts from there.
    """
    config = copy.deepcopy(model.config)
    config.num_hidden_layers *= factor
    deep = DualFlowForCausalLM(config)
    state = {}
    for name, value in model.state_dict().items():
        prefix, _, rest = name.partition("model.layers.")
        if prefix or not rest:
            state[name] = value
            continue
        index, _, field = rest.partition(".")
        for repeat in range(factor):
            state[f"model.layers.{factor * int(index) + repeat}.{field}"] = value.clone()
    deep.load_state_dict(state)
    return deep


def qwen3_moe_config_of(config: DualFlowConfig) -> Qwen3MoeConfig:
    """The transformers Qwen3-MoE config of a Dual-Flow config's primary flow (untied LM head, like Dual-Flow's)."""
    return Qwen3MoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=config.mlp_only_layers,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=config.rope_parameters,
        router_aux_loss_coef=config.router_aux_loss_coef,
        attention_bias=config.attention_bias,
        tie_word_embeddings=False,
    )


def save_as_qwen3_moe(model: DualFlowForCausalLM, folder: Path) -> Path:
    """Save the primary flow of a single-flow Dual-Flow model as transformers' Qwen3-MoE (same weight names)."""
    source = Qwen3MoeForCausalLM(qwen3_moe_config_of(model.config))
    aux = set(model.aux_parameter_names())
    source.load_state_dict({name: value for name, value in model.state_dict().items() if name not in aux})
    source.save_pretrained(folder)
    return folder


def trainable_model(recipe: Recipe, folder: Path):
    """Load the converted checkpoint for `recipe` and leave exactly its parameters trainable."""
    dual = recipe.aux_factor is not None
    model = DualFlowForCausalLM.from_pretrained(folder, use_aux_flow=dual)
    if recipe.depth_factor > 1:
        model = depth_upscaled(model, recipe.depth_factor)
    if recipe.round_gates_open:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.aux_round_gate.weight.fill_(1.0)
    if recipe.train == "lora":
        rank = recipe.lora_rank or adapter_budget_lora_rank(folder)
        return add_lora(model, r=rank, lora_alpha=2 * rank, train_aux_modules=recipe.aux_factor is not None)
    if recipe.aux_factor is None:  # single flow: the aux parameters exist but take no part
        freeze_aux_flow(model)
    elif recipe.train == "aux":
        freeze_for_aux_training(model)
    return model
