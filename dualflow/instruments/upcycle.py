"""`dualflow experiment --regime upcycle`: the package's real use, measured end to end.

Per seed: pretrain a single-flow MoE, save it as a transformers Qwen3-MoE checkpoint, convert it with the real
`convert_checkpoint` (k_a = k_p and k_a = 2 k_p), then continue every recipe for the same tokens on the same new
batches: the single-flow model continued (what a user would otherwise do), dual full training, dual aux-only, and
LoRA on the shared weights + the aux flow. Aux (prediction) and primary validation losses are paired by seed.
`--arms` picks recipes or groups (default, lr, all); `--resume` trains only the recipe/seed runs an earlier
report lacks, after checking that each seed's retrained base is the one it was paired with.
"""

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils.logging import disable_progress_bar

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM

from ..convert import convert_checkpoint
from ..errors import DualFlowUserError
from ..lora import add_lora
from ..scoring import mean_token_nll, mean_token_nlls
from .report import command_line, made_the_same_way, print_footer
from .runner import fork_pool, load_corpus
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
    lora): the rank whose trainable parameters match the aux-adapter recipe's. `learning_rate_factor` scales the
    scale's learning rate.
    """

    name: str
    aux_factor: int | None
    train: str
    adapter_rank: int = 0
    lora_rank: int | None = 16
    learning_rate_factor: float = 1.0


DEFAULT_RECIPES = (
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
    # The same-rank row: LoRA r16 on the single flow, beside dual LoRA r16 + the aux flow.
    Recipe("single lora r16", None, "lora"),
)
# A small learning-rate sweep of the recipes that train few parameters, so none loses on an untuned rate (x10: the
# best of x1/3, x1, x3 was x3 for every one of them), with the same-rank single-flow LoRA swept beside them.
LEARNING_RATE_FACTORS = (1 / 3, 3.0, 10.0)
LEARNING_RATE_RECIPES = tuple(
    replace(recipe, name=f"{recipe.name} lr x{factor:.2g}", learning_rate_factor=factor)
    for recipe in DEFAULT_RECIPES
    if recipe.name
    in ("dual lora+aux ka=2kp", "dual aux-only ka=2kp", "dual aux-only+adapters ka=2kp", "single lora r16")
    for factor in LEARNING_RATE_FACTORS
)
RECIPES = DEFAULT_RECIPES + LEARNING_RATE_RECIPES
RECIPES_BY_NAME = {recipe.name: recipe for recipe in RECIPES}
RECIPE_GROUPS = {
    "default": tuple(recipe.name for recipe in DEFAULT_RECIPES),
    "lr": tuple(recipe.name for recipe in LEARNING_RATE_RECIPES),
    "all": tuple(RECIPES_BY_NAME),
}
BASELINE = DEFAULT_RECIPES[0].name


def select_recipes(names) -> list[Recipe]:
    """The recipes and groups `names` ask for (default: the default group); the baseline always comes first."""
    chosen = [BASELINE]
    for name in names or ["default"]:
        for member in RECIPE_GROUPS.get(name, (name,)):
            if member not in RECIPES_BY_NAME:
                raise DualFlowUserError(
                    f"unknown upcycle recipe {member!r}; recipes: {', '.join(RECIPES_BY_NAME)}; "
                    f"groups: {', '.join(RECIPE_GROUPS)}"
                )
            if member not in chosen:
                chosen.append(member)
    return [RECIPES_BY_NAME[name] for name in chosen]


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
    dual = recipe.aux_factor is not None
    model = DualFlowForCausalLM.from_pretrained(folder, use_aux_flow=dual)
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


def upcycle_seed(
    recipes, scale: TinyScale, continue_steps: int, seed: int, train_tokens, val_blocks, earlier_base=None
) -> dict:
    """
    Pretrain, save, convert and continue every recipe for one seed; returns {"base": ..., recipe name: run}.
    `earlier_base`: the base this seed's earlier runs continued (--resume); a retrained base that differs stops here.
    """
    torch.set_num_threads(1)
    config = tiny_moe_config(scale, top_k=2, qk_norm="per_head")  # Qwen3-MoE normalises q and k per head
    base, _ = train_language_model(config, train_tokens, scale, seed, show_progress=False)
    result = {"base": {"seed": seed, **losses(base, val_blocks, dual=False)}}
    if earlier_base is not None and abs(result["base"]["primary_val_loss"] - earlier_base["primary_val_loss"]) > 1e-6:
        raise DualFlowUserError(
            f"--resume: seed {seed}'s retrained base has val loss {result['base']['primary_val_loss']:.6f}, the "
            f"report's {earlier_base['primary_val_loss']:.6f}; its runs cannot be paired (use another --out)"
        )
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
            recipe_scale = replace(scale, learning_rate=scale.learning_rate * recipe.learning_rate_factor)
            train_model(
                model, train_tokens, recipe_scale, seed + CONTINUE_SEED_OFFSET, continue_steps, show_progress=False
            )
            train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
            tokens = continue_steps * scale.batch_size * scale.block_size
            result[recipe.name] = {
                "seed": seed,
                "trainable_params": model.num_parameters(only_trainable=True),
                "learning_rate": recipe_scale.learning_rate,
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
        runs = [result[recipe.name] for result in per_seed if recipe.name in result]
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


def previous_upcycle(path: Path, scale: TinyScale, continue_steps: int, data: dict) -> tuple[dict, dict]:
    """({seed: {"base": ..., recipe name: run}}, the report) of an earlier upcycle report made the same way."""
    previous = json.loads(path.read_text())
    if not made_the_same_way(previous, SCHEMA, scale, data) or previous["continue_steps"] != continue_steps:
        raise DualFlowUserError(
            f"--resume: {path} was made with another scale, data, steps or schema; use another --out"
        )
    per_seed = {run["seed"]: {"base": run} for run in previous["base"]["runs"]}
    for recipe in previous["recipes"]:
        for run in recipe["runs"]:
            per_seed[run["seed"]][recipe["name"]] = run
    return per_seed, previous


def merge_seed(earlier: dict | None, result: dict) -> dict:
    """One seed's earlier runs and this invocation's (whose base `upcycle_seed` found equal to the earlier one)."""
    if earlier is None:
        return result
    runs = {name: run for name, run in result.items() if name != "base"}
    return earlier | runs | {"base": earlier["base"] | result["base"]}


def run_upcycle(args, scale: TinyScale, num_seeds: int, jobs: int) -> int:
    """Pretrain `scale.steps`, continue `--continue-steps` (default half as many); the options were checked by
    `experiment.run`."""
    continue_steps = args.continue_steps or max(1, scale.steps // 2)
    if continue_steps < 1:
        raise DualFlowUserError(f"--continue-steps must be >= 1, got {continue_steps}")
    recipes = select_recipes(args.arms)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DualFlowUserError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    train_tokens, val_blocks, data = load_corpus(args.data, scale)
    earlier, previous = previous_upcycle(out / "upcycle.json", scale, continue_steps, data) if args.resume else ({}, {})
    disable_progress_bar()  # transformers' per-load weight bars, dozens per seed
    started = time.perf_counter()
    tasks = []
    for seed in range(num_seeds):
        missing = [recipe for recipe in recipes if recipe.name not in earlier.get(seed, {})]
        if missing:
            earlier_base = earlier[seed]["base"] if seed in earlier else None
            tasks.append((missing, scale, continue_steps, seed, train_tokens, val_blocks, earlier_base))
    if jobs == 1 or len(tasks) < 2:
        results = [upcycle_seed(*task) for task in tasks]
    else:
        with fork_pool(min(jobs, len(tasks))) as pool:
            results = pool.starmap(upcycle_seed, tasks)
    by_seed = dict(earlier)
    for result in results:
        by_seed[result["base"]["seed"]] = merge_seed(earlier.get(result["base"]["seed"]), result)
    per_seed = [by_seed[seed] for seed in sorted(by_seed)]
    names = {name for result in per_seed for name in result}
    summary = summarize([recipe for recipe in RECIPES if recipe.name in names], per_seed)
    base = mean_and_error([result["base"]["primary_val_loss"] for result in per_seed])
    report = {
        "schema": SCHEMA,
        "command": command_line(args),
        "commands": previous.get("commands", [previous["command"]] if previous else []) + [command_line(args)],
        "quick": args.quick,
        "scale": asdict(scale),
        "pretrain_steps": scale.steps,
        "continue_steps": continue_steps,
        "seeds": sorted(by_seed),
        "data": data,
        "wall_s_total": previous.get("wall_s_total", 0.0) + time.perf_counter() - started,
        "base": {"primary_val_loss": base, "runs": [result["base"] for result in per_seed]},
        "recipes": summary,
        "table": format_table(summary, base),
    }
    (out / "upcycle.json").write_text(json.dumps(report, indent=1))
    print(report["table"])
    print(
        f"prediction = aux flow for dual recipes; Δ paired by seed, ± = standard error over the seeds each recipe "
        f"ran ({len(per_seed)} at most); pretrain {scale.steps} steps, continue {continue_steps} steps. "
        f"Total {report['wall_s_total'] / 60:.1f} min."
    )
    print_footer([out / "upcycle.json"], args.quick)
    return 0
