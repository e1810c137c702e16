"""`dualflow experiment --regime upcycle`: the package's real use, measured end to end.

Per seed: pretrain a single-flow MoE, save it as a transformers Qwen3-MoE checkpoint, convert it with the real
`convert_checkpoint` (k_a = k_p and k_a = 2 k_p), then continue every recipe for the same tokens on the same new
batches: the single-flow model continued (what a user would otherwise do), dual full training, dual aux-only, and
LoRA on the shared weights + the aux flow. Aux (prediction) and primary validation losses are paired by seed.
"""

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils.logging import disable_progress_bar

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM

from ..convert import convert_checkpoint
from ..errors import DualFlowUserError
from ..lora import add_lora
from ..scoring import mean_token_nll, mean_token_nlls
from .report import command_line, print_footer
from .runner import load_corpus
from .stats import format_error, mean_and_error, paired_differences
from .tables import text_table
from .tiny_lm import TinyScale, tiny_moe_config, train_language_model, train_model


SCHEMA = "dualflow-upcycle/1"
CONTINUE_SEED_OFFSET = 10_000  # continued training draws batches the pretraining never drew in that order


ADAPTER_RANK = 16  # the prototype's rank


@dataclass(frozen=True)
class Recipe:
    """
    How to continue: `aux_factor` None = single flow, else k_a = aux_factor * k_p; `train` = all / aux / lora;
    `adapter_rank`: converted with aux adapters of that rank (`--aux-adapter-rank`). `lora_rank` None (with train =
    lora): the rank whose trainable parameters match the aux-adapter recipe's.
    """

    name: str
    aux_factor: int | None
    train: str
    adapter_rank: int = 0
    lora_rank: int | None = 16


RECIPES = (
    Recipe("single continued", None, "all"),
    # What a user could do with the aux adapters' parameter budget without Dual-Flow.
    Recipe("single lora, adapter budget", None, "lora", lora_rank=None),
    Recipe("dual full ka=kp", 1, "all"),
    Recipe("dual full ka=2kp", 2, "all"),
    Recipe("dual aux-only ka=kp", 1, "aux"),
    Recipe("dual aux-only ka=2kp", 2, "aux"),
    Recipe("dual lora+aux ka=kp", 1, "lora"),
    Recipe("dual lora+aux ka=2kp", 2, "lora"),
    Recipe("dual aux-only+adapters ka=kp", 1, "aux", ADAPTER_RANK),
    Recipe("dual aux-only+adapters ka=2kp", 2, "aux", ADAPTER_RANK),
)
BASELINE = RECIPES[0].name


def adapter_budget_lora_rank(folder: Path) -> int:
    """The LoRA rank on the single-flow model of `folder` whose trainable parameters come closest to the aux-adapter
    recipe's (aux embedding, couplings and rank-`ADAPTER_RANK` adapters); LoRA's count is linear in the rank."""
    config = DualFlowConfig.from_pretrained(folder)
    budget = (
        DualFlowForCausalLM(DualFlowConfig.from_pretrained(folder, aux_adapter_rank=ADAPTER_RANK))
        .freeze_for_aux_training()
        .num_parameters(only_trainable=True)
    )
    per_rank = add_lora(DualFlowForCausalLM(config), r=1, train_aux_modules=False).num_parameters(only_trainable=True)
    return max(1, round(budget / per_rank))


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
    model = DualFlowForCausalLM.from_pretrained(folder, use_aux_flow=recipe.aux_factor is not None)
    if recipe.train == "lora":
        rank = recipe.lora_rank or adapter_budget_lora_rank(folder)
        return add_lora(model, r=rank, lora_alpha=2 * rank, train_aux_modules=recipe.aux_factor is not None)
    if recipe.aux_factor is None:  # single flow: the aux parameters exist but take no part
        model.freeze_aux_flow()
    elif recipe.train == "aux":
        model.freeze_for_aux_training()
    return model


def losses(model, val_blocks, dual: bool) -> dict:
    if not dual:
        return {"aux_val_loss": None, "primary_val_loss": mean_token_nll(model, val_blocks, 32, use_aux_flow=False)}
    both = mean_token_nlls(model, val_blocks, ("logits", "primary_logits"), batch_size=32, use_aux_flow=True)
    return {"aux_val_loss": both["logits"], "primary_val_loss": both["primary_logits"]}


def upcycle_seed(recipes, scale: TinyScale, continue_steps: int, seed: int, train_tokens, val_blocks) -> dict:
    """Pretrain, save, convert and continue every recipe for one seed; returns {"base": ..., recipe name: run}."""
    torch.set_num_threads(1)
    config = tiny_moe_config(scale, top_k=2, qk_norm="per_head")  # Qwen3-MoE normalises q and k per head
    base, _ = train_language_model(config, train_tokens, scale, seed, show_progress=False)
    result = {"base": {"seed": seed, **losses(base, val_blocks, dual=False)}}
    with tempfile.TemporaryDirectory(prefix="dualflow-upcycle-") as tmp:
        source = save_as_qwen3_moe(base, Path(tmp) / "qwen3-moe")
        converted = {}  # (k_a / k_p, adapter rank): folder written by the real converter
        for factor, rank in sorted({(recipe.aux_factor or 1, recipe.adapter_rank) for recipe in recipes}):
            folder = converted[factor, rank] = Path(tmp) / f"dualflow-ka{factor}x-adapters{rank}"
            convert_checkpoint(
                source,
                folder,
                aux_top_k=factor * config.num_experts_per_tok,
                aux_adapter_rank=rank,
                show_progress=False,
            )
            if not rank:
                initial = DualFlowForCausalLM.from_pretrained(folder)
                result["base"][f"aux_val_loss_at_conversion_ka{factor}x"] = losses(initial, val_blocks, dual=True)[
                    "aux_val_loss"
                ]
        for recipe in recipes:
            model = trainable_model(recipe, converted[recipe.aux_factor or 1, recipe.adapter_rank])
            start, cpu_start = time.perf_counter(), time.process_time()
            train_model(model, train_tokens, scale, seed + CONTINUE_SEED_OFFSET, continue_steps, show_progress=False)
            train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
            tokens = continue_steps * scale.batch_size * scale.block_size
            result[recipe.name] = {
                "seed": seed,
                "trainable_params": model.num_parameters(only_trainable=True),
                **({"lora_rank": model.peft_config["default"].r} if recipe.train == "lora" else {}),
                # CPU seconds too: on a shared machine the wall clock also counts other processes' turns.
                "tokens_per_s": tokens / train_s,
                "tokens_per_cpu_s": tokens / cpu_s,
                **losses(model, val_blocks, dual=recipe.aux_factor is not None),
            }
    return result


def summarize(recipes, per_seed: list[dict]) -> list[dict]:
    """Per recipe: losses over seeds and their paired differences to the single-flow continued model and the base."""
    base_runs = [result["base"] for result in per_seed]
    baseline_runs = [{**result[BASELINE], "val_loss": result[BASELINE]["primary_val_loss"]} for result in per_seed]
    base_as_baseline = [{**run, "val_loss": run["primary_val_loss"]} for run in base_runs]
    summary = []
    for recipe in recipes:
        runs = [result[recipe.name] for result in per_seed]
        key = "aux_val_loss" if recipe.aux_factor else "primary_val_loss"
        entry = {"name": recipe.name, **asdict(recipe), "runs": runs}
        entry["trainable_params"] = runs[0]["trainable_params"]
        for speed in ("tokens_per_s", "tokens_per_cpu_s"):
            entry[speed] = statistics.median(run[speed] for run in runs)
        for loss in ("aux_val_loss", "primary_val_loss"):
            values = [run[loss] for run in runs if run[loss] is not None]
            entry[loss] = mean_and_error(values) if values else None
        entry["prediction_vs_single_continued"] = mean_and_error(
            list(paired_differences(runs, baseline_runs, key).values())
        )
        entry["prediction_vs_base"] = mean_and_error(list(paired_differences(runs, base_as_baseline, key).values()))
        entry["primary_vs_single_continued"] = mean_and_error(
            list(paired_differences(runs, baseline_runs, "primary_val_loss").values())
        )
        summary.append(entry)
    return summary


def format_table(summary: list[dict], base: dict) -> str:
    header = ["recipe", "prediction val loss", "Δ vs single continued", "Δ vs base", "primary Δ vs single continued"]
    header += ["trainable params", "train tok/s (wall / CPU)"]
    rows = [["base (pretrained)", f"{base['mean']:.4f}", "-", "-", "-", "-", "-"]]
    for entry in summary:
        loss = entry["aux_val_loss"] or entry["primary_val_loss"]
        rows.append(
            [
                entry["name"],
                format_error(loss, sign=False),
                format_error(entry["prediction_vs_single_continued"]),
                format_error(entry["prediction_vs_base"]),
                format_error(entry["primary_vs_single_continued"]),
                f"{entry['trainable_params']:,}",
                f"{entry['tokens_per_s']:.0f} / {entry['tokens_per_cpu_s']:.0f}",
            ]
        )
    return text_table(header, rows)


def run_upcycle(args, scale: TinyScale, num_seeds: int, jobs: int) -> int:
    """Pretrain `scale.steps`, continue half as many; the options were checked by `experiment.run`."""
    continue_steps = max(1, scale.steps // 2)
    recipes = list(RECIPES)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DualFlowUserError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    train_tokens, val_blocks, data = load_corpus(args.data, scale)
    disable_progress_bar()  # transformers' per-load weight bars, dozens per seed
    started = time.perf_counter()
    tasks = [(recipes, scale, continue_steps, seed, train_tokens, val_blocks) for seed in range(num_seeds)]
    if jobs == 1:
        per_seed = [upcycle_seed(*task) for task in tasks]
    else:
        with get_context("fork").Pool(min(jobs, num_seeds)) as pool:
            per_seed = pool.starmap(upcycle_seed, tasks)
    summary = summarize(recipes, per_seed)
    base = mean_and_error([result["base"]["primary_val_loss"] for result in per_seed])
    report = {
        "schema": SCHEMA,
        "command": command_line(args),
        "quick": args.quick,
        "scale": asdict(scale),
        "pretrain_steps": scale.steps,
        "continue_steps": continue_steps,
        "seeds": list(range(num_seeds)),
        "data": data,
        "wall_s_total": time.perf_counter() - started,
        "base": {"primary_val_loss": base, "runs": [result["base"] for result in per_seed]},
        "recipes": summary,
        "table": format_table(summary, base),
    }
    (out / "upcycle.json").write_text(json.dumps(report, indent=1))
    print(report["table"])
    print(
        f"prediction = aux flow for dual recipes; Δ paired by seed, ± = standard error over {num_seeds} seed(s); "
        f"pretrain {scale.steps} steps, continue {continue_steps} steps. Total {report['wall_s_total'] / 60:.1f} min."
    )
    print_footer([out / "upcycle.json"], args.quick)
    return 0
