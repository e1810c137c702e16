"""
One seed of the upcycling regime: pretrain the single-flow base, save it as Qwen3-MoE, convert it with the real
`convert_checkpoint`, continue every recipe for its steps on new batches and score each run.
"""

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from modeling_dualflow import DualFlowForCausalLM

from ..convert import convert_checkpoint
from ..errors import DualFlowUserError
from ..lora import projection_rank
from ..scoring import mean_token_nll, mean_token_nlls
from .tiny_lm import TinyScale, tiny_moe_config, train_language_model, train_model
from .upcycle_models import save_as_qwen3_moe, trainable_model
from .upcycle_recipes import PRETRAIN_TOP_K, Recipe, recipe_steps


CONTINUE_SEED_OFFSET = 10_000  # continued training draws batches the pretraining never drew in that order


def losses(model, val_blocks, dual: bool) -> dict:
    if not dual:
        return {"aux_val_loss": None, "primary_val_loss": mean_token_nll(model, val_blocks, 32, use_aux_flow=False)}
    both = mean_token_nlls(model, val_blocks, ("logits", "primary_logits"), batch_size=32, use_aux_flow=True)
    return {"aux_val_loss": both["logits"], "primary_val_loss": both["primary_logits"]}


def upcycle_seed(
    recipes, scale: TinyScale, continue_steps: int, seed: int, train_tokens, val_blocks, earlier_base=None
) -> dict:
    """
    Pretrain, save, convert and continue every recipe for one seed; returns {"base": ..., recipe name: run}.
    `earlier_base`: the base this seed's earlier runs continued (--resume); a retrained base that differs stops here.
    """
    torch.set_num_threads(1)
    config = tiny_moe_config(scale, top_k=PRETRAIN_TOP_K, qk_norm="per_head")  # Qwen3-MoE normalises q and k per head
    base, _ = train_language_model(config, train_tokens, scale, seed, show_progress=False)
    result = {"base": {"seed": seed, **losses(base, val_blocks, dual=False)}}
    if earlier_base is not None and abs(result["base"]["primary_val_loss"] - earlier_base["primary_val_loss"]) > 1e-6:
        raise DualFlowUserError(
            f"--resume: seed {seed}'s retrained base has val loss {result['base']['primary_val_loss']:.6f}, the "
            f"report's {earlier_base['primary_val_loss']:.6f}; its runs cannot be paired (use another --out)"
        )
    with tempfile.TemporaryDirectory(prefix="dualflow-upcycle-") as tmp:
        source = save_as_qwen3_moe(base, Path(tmp) / "qwen3-moe")
        converted = {}  # (k_a / k_p, adapter rank, aux rounds): folder written by the real converter
        for factor, rank, rounds in sorted(
            {(recipe.aux_factor or 1, recipe.adapter_rank, recipe.aux_rounds) for recipe in recipes}
        ):
            folder = converted[factor, rank, rounds] = Path(tmp) / f"dualflow-ka{factor}x-adapters{rank}-r{rounds}"
            convert_checkpoint(
                source,
                folder,
                aux_top_k=factor * config.num_experts_per_tok,
                aux_adapter_rank=rank,
                aux_rounds=rounds,
                show_progress=False,
            )
            if not rank and rounds == 1:
                initial = DualFlowForCausalLM.from_pretrained(folder)
                result["base"][f"aux_val_loss_at_conversion_ka{factor}x"] = losses(initial, val_blocks, dual=True)[
                    "aux_val_loss"
                ]
        for recipe in recipes:
            folder = converted[recipe.aux_factor or 1, recipe.adapter_rank, recipe.aux_rounds]
            result[recipe.name] = continue_recipe(recipe, folder, scale, continue_steps, seed, train_tokens, val_blocks)
    return result


def continue_recipe(
    recipe: Recipe, folder: Path, scale: TinyScale, continue_steps: int, seed: int, train_tokens, val_blocks
) -> dict:
    """Continue the converted checkpoint `folder` by `recipe` on new batches: its steps, size, speed and losses."""
    model = trainable_model(recipe, folder)
    start, cpu_start = time.perf_counter(), time.process_time()
    recipe_scale = replace(scale, learning_rate=scale.learning_rate * recipe.learning_rate_factor)
    steps = recipe_steps(recipe, scale, continue_steps)
    train_model(
        model,
        train_tokens,
        recipe_scale,
        seed + CONTINUE_SEED_OFFSET,
        steps,
        show_progress=False,
        round_gate_lr_factor=recipe.round_gate_lr_factor,
    )
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = steps * scale.batch_size * scale.block_size
    run = {
        "seed": seed,
        "steps": steps,
        "trainable_params": model.num_parameters(only_trainable=True),
        "learning_rate": recipe_scale.learning_rate,
        **({"lora_rank": projection_rank(model.peft_config["default"].to_dict())[0]} if recipe.train == "lora" else {}),
        # CPU seconds too: on a shared machine the wall clock also counts other processes' turns.
        "tokens_per_s": tokens / train_s,
        "tokens_per_cpu_s": tokens / cpu_s,
        **losses(model, val_blocks, dual=recipe.aux_factor is not None),
    }
    gates = [parameter for name, parameter in model.named_parameters() if ".aux_round_gate." in name]
    if gates and recipe.aux_factor is not None:  # how far the rounds opened (0 = the converted identity)
        values = torch.cat([gate.detach().flatten() for gate in gates])
        run |= {
            "round_gate_mean": values.mean().item(),
            "round_gate_mean_abs": values.abs().mean().item(),
        }
    return run
