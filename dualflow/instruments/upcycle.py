"""`dualflow experiment --regime upcycle`: the package's real use, measured end to end.

Per seed: pretrain a single-flow MoE, save it as a transformers Qwen3-MoE checkpoint, convert it with the real
`convert_checkpoint` (k_a = k_p and k_a = 2 k_p), then continue every recipe for the same tokens on the same new
batches: the single-flow model continued (what a user would otherwise do), dual full training, dual aux-only, and
LoRA on the shared weights + the aux flow. Aux (prediction) and primary validation losses are paired by seed, with
the single-flow model continued for the same tokens and, where the report has one, with the single-flow model
continued for the same training FLOPs (more steps on new batches). `--arms` picks recipes or groups (default, lr,
compute, rounds, all); `--resume` trains only the recipe/seed runs an earlier report lacks, after checking that each
seed's retrained base is the one it was paired with. `--base-steps` repeats the study for bases pretrained for
several lengths (a folder each) and fits the trend of each dual recipe's gain with the base's length.
"""

import copy
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils.logging import disable_progress_bar

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM

from ..aux_training import freeze_aux_flow, freeze_for_aux_training
from ..convert import convert_checkpoint
from ..errors import DualFlowUserError
from ..lora import add_lora
from ..scoring import mean_token_nll, mean_token_nlls
from .arms import arm_costs, dual, single, with_steps
from .report import command_line, format_share, made_the_same_way, print_footer
from .runner import fork_pool, load_corpus
from .stats import format_error, mean_and_error, paired_differences, ratio_and_error
from .tables import text_table
from .tiny_lm import TinyScale, tiny_moe_config, train_language_model, train_model


SCHEMA = "dualflow-upcycle/1"
BASE_LENGTH_SCHEMA = "dualflow-upcycle-base-length/1"
CONTINUE_SEED_OFFSET = 10_000  # continued training draws batches the pretraining never drew in that order
PRETRAIN_TOP_K = 2  # the base is single-flow k2


ADAPTER_RANK = 16  # the prototype's rank


@dataclass(frozen=True)
class Recipe:
    """
    How to continue: `aux_factor` None = single flow, else k_a = aux_factor * k_p; `train` = all / aux / lora;
    `adapter_rank`: converted with aux adapters of that rank (`--aux-adapter-rank`). `lora_rank` None (with train =
    lora): the rank whose trainable parameters match the aux-adapter recipe's. `learning_rate_factor` scales the
    scale's learning rate. `aux_rounds`: converted with that many aux rounds (`--aux-rounds`, closed gates), whose
    gates train at `round_gate_lr_factor` x the rate. `depth_factor`: the single-flow model with each layer repeated
    that many times in place (depth up-scaling). `compute_of`: continue for the training FLOPs that recipe spends
    in the continued steps (more steps, new batches) instead of for the same tokens. `round_gates_open`: the round
    gates set to 1 after conversion, as a new model starts them (the converted model then no longer computes as the
    base; training starts from there).
    """

    name: str
    aux_factor: int | None
    train: str
    adapter_rank: int = 0
    lora_rank: int | None = 16
    learning_rate_factor: float = 1.0
    aux_rounds: int = 1
    round_gate_lr_factor: float = 1.0
    depth_factor: int = 1
    compute_of: str | None = None
    round_gates_open: bool = False


def equal_compute(reference: str) -> Recipe:
    """The single-flow model continued for the training FLOPs of the recipe `reference`."""
    return Recipe(f"single continued, compute of {reference}", None, "all", compute_of=reference)


DEFAULT_RECIPES = (
    Recipe("single continued", None, "all"),
    equal_compute("dual full ka=2kp"),
    equal_compute("dual full ka=kp"),
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
# A gentler continuation for a well-trained base, which the common rate leaves worse than it was: the full single
# and dual fine-tunes at a third of the rate; the dual one is compared with the single one of its own rate.
GENTLE_RATE_FACTOR = 1 / 3
GENTLE_RATE_RECIPES = tuple(
    replace(recipe, name=f"{recipe.name} lr x{GENTLE_RATE_FACTOR:.2g}", learning_rate_factor=GENTLE_RATE_FACTOR)
    for recipe in DEFAULT_RECIPES
    if recipe.name in ("single continued", "dual full ka=2kp")
)
# Buying depth after pretraining: the aux flow converted with more rounds (closed gates, exact parity), the gates
# trained at 10x the rate so they can open within the continued steps, or opened at the start, against depth
# up-scaling (2x prefill and KV) and the single-flow model continued for each one's compute.
GATE_LR_FACTOR = 10.0
R3_FAST_GATES = f"dual full r3 ka=2kp gate lr x{GATE_LR_FACTOR:g}"
DEPTH_UPSCALED = "single depth 2x (layers repeated)"
ROUNDS_RECIPES = (
    Recipe("dual full r2 ka=2kp", 2, "all", aux_rounds=2),
    Recipe(
        f"dual full r2 ka=2kp gate lr x{GATE_LR_FACTOR:g}", 2, "all", aux_rounds=2, round_gate_lr_factor=GATE_LR_FACTOR
    ),
    Recipe(R3_FAST_GATES, 2, "all", aux_rounds=3, round_gate_lr_factor=GATE_LR_FACTOR),
    # the gates where training from scratch found the rounds' gain: open from the first step, parity given up
    Recipe("dual full r2 ka=2kp gates open", 2, "all", aux_rounds=2, round_gates_open=True),
    Recipe(DEPTH_UPSCALED, None, "all", depth_factor=2),
    equal_compute("dual full r2 ka=2kp"),
    equal_compute(R3_FAST_GATES),
    equal_compute(DEPTH_UPSCALED),
)
RECIPES = DEFAULT_RECIPES + LEARNING_RATE_RECIPES + GENTLE_RATE_RECIPES + ROUNDS_RECIPES
RECIPES_BY_NAME = {recipe.name: recipe for recipe in RECIPES}
RECIPE_GROUPS = {
    "default": tuple(recipe.name for recipe in DEFAULT_RECIPES),
    "lr": tuple(recipe.name for recipe in LEARNING_RATE_RECIPES),
    "gentle": tuple(recipe.name for recipe in GENTLE_RATE_RECIPES),
    # the base-length study: dual full k_a = 2 k_p beside single continued for its tokens and for its compute
    "compute": ("single continued", "single continued, compute of dual full ka=2kp", "dual full ka=2kp"),
    "rounds": ("dual full ka=2kp", "single continued, compute of dual full ka=2kp")
    + tuple(recipe.name for recipe in ROUNDS_RECIPES),
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
    budget = freeze_for_aux_training(
        DualFlowForCausalLM(DualFlowConfig.from_pretrained(folder, aux_adapter_rank=ADAPTER_RANK))
    ).num_parameters(only_trainable=True)
    per_rank = add_lora(DualFlowForCausalLM(config), r=1, train_aux_modules=False).num_parameters(only_trainable=True)
    return max(1, round(budget / per_rank))


def recipe_train_flops_per_token(recipe: Recipe, scale: TinyScale) -> float:
    """Training FLOPs per token of the model `recipe` continues, by the experiment's formula (`arms.FLOPS_FORMULA`)."""
    if recipe.aux_factor is None:
        arm = single(PRETRAIN_TOP_K, depth_factor=recipe.depth_factor)
    else:
        arm = dual(PRETRAIN_TOP_K, recipe.aux_factor * PRETRAIN_TOP_K, aux_num_rounds=recipe.aux_rounds)
    return arm_costs(arm, scale)["train_flops_per_token"]


def recipe_steps(recipe: Recipe, scale: TinyScale, continue_steps: int) -> int:
    """`continue_steps`, or for an equal-compute recipe the steps that spend its reference's training FLOPs."""
    if recipe.compute_of is None:
        return continue_steps
    ratio = recipe_train_flops_per_token(RECIPES_BY_NAME[recipe.compute_of], scale) / recipe_train_flops_per_token(
        recipe, scale
    )
    return max(1, round(continue_steps * ratio))


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
            model = trainable_model(recipe, converted[recipe.aux_factor or 1, recipe.adapter_rank, recipe.aux_rounds])
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
            result[recipe.name] = {
                "seed": seed,
                "steps": steps,
                "trainable_params": model.num_parameters(only_trainable=True),
                "learning_rate": recipe_scale.learning_rate,
                **({"lora_rank": model.peft_config["default"].r} if recipe.train == "lora" else {}),
                # CPU seconds too: on a shared machine the wall clock also counts other processes' turns.
                "tokens_per_s": tokens / train_s,
                "tokens_per_cpu_s": tokens / cpu_s,
                **losses(model, val_blocks, dual=recipe.aux_factor is not None),
            }
            gates = [parameter for name, parameter in model.named_parameters() if ".aux_round_gate." in name]
            if gates and recipe.aux_factor is not None:  # how far the rounds opened (0 = the converted identity)
                values = torch.cat([gate.detach().flatten() for gate in gates])
                result[recipe.name] |= {
                    "round_gate_mean": values.mean().item(),
                    "round_gate_mean_abs": values.abs().mean().item(),
                }
    return result


def paired(runs: list[dict], baseline_runs: list[dict], key: str) -> dict | None:
    """Mean ± SE of the paired differences run[key] - baseline primary loss, with the per-seed values (None if none)."""
    by_seed = paired_differences(runs, baseline_runs, key)
    return {**mean_and_error(list(by_seed.values())), "by_seed": by_seed} if by_seed else None


def summarize(recipes, per_seed: list[dict], scale: TinyScale) -> list[dict]:
    """
    Per recipe: losses over seeds and their paired differences to the single-flow continued model (a dual recipe's:
    the one at its own learning rate, where the report has it), to the base, and
    (dual recipes) to the single-flow model continued for the same training FLOPs per token, where the report has it,
    and their gain's share of depth up-scaling's (both over single continued; 2 seeds or more).
    """
    base_runs = [result["base"] for result in per_seed]

    def as_baseline(runs):
        return [{**run, "val_loss": run["primary_val_loss"]} for run in runs]

    def runs_of(name):
        return [result[name] for result in per_seed if name in result]

    flops = {recipe.name: recipe_train_flops_per_token(recipe, scale) for recipe in recipes}
    equal_compute_of = {  # training FLOPs per token -> the single-flow recipe that spends them
        flops[recipe.compute_of]: recipe.name
        for recipe in recipes
        if recipe.compute_of is not None and recipe.compute_of in flops
    }
    single_continued_at_rate = {  # learning-rate factor -> the baseline recipe continued at that rate
        recipe.learning_rate_factor: recipe.name
        for recipe in recipes
        if replace(recipe, name=BASELINE, learning_rate_factor=1.0) == RECIPES_BY_NAME[BASELINE]
    }
    depth_gain = paired(runs_of(DEPTH_UPSCALED), as_baseline(runs_of(BASELINE)), "primary_val_loss")
    summary = []
    for recipe in recipes:
        runs = runs_of(recipe.name)
        key = "aux_val_loss" if recipe.aux_factor else "primary_val_loss"
        single_continued = BASELINE
        if recipe.aux_factor:
            single_continued = single_continued_at_rate.get(recipe.learning_rate_factor, BASELINE)
        entry = {"name": recipe.name, **asdict(recipe), "runs": runs, "single_continued": single_continued}
        entry["trainable_params"] = runs[0]["trainable_params"]
        entry["steps"] = runs[0].get("steps")  # reports made before equal-compute recipes lack it
        entry["train_flops_per_token"] = flops[recipe.name]
        for speed in ("tokens_per_s", "tokens_per_cpu_s"):
            entry[speed] = statistics.median(run[speed] for run in runs)
        for loss in ("aux_val_loss", "primary_val_loss"):
            values = [run[loss] for run in runs if run[loss] is not None]
            entry[loss] = mean_and_error(values) if values else None
        single_runs = as_baseline(runs_of(single_continued))
        entry["prediction_vs_single_continued"] = paired(runs, single_runs, key)
        entry["prediction_vs_base"] = paired(runs, as_baseline(base_runs), key)
        entry["primary_vs_single_continued"] = paired(runs, single_runs, "primary_val_loss")
        partner = equal_compute_of.get(flops[recipe.name]) if recipe.aux_factor else None
        comparison = paired(runs, as_baseline(runs_of(partner)), key) if partner else None
        entry["prediction_vs_single_equal_compute"] = {"vs": partner, **comparison} if comparison else None
        gain = entry["prediction_vs_single_continued"]
        entry["share_of_depth_upscaling_gain"] = (
            ratio_and_error(gain["by_seed"], depth_gain["by_seed"])
            if recipe.aux_factor and gain and depth_gain and single_continued == BASELINE
            else None
        )
        summary.append(entry)
    return summary


def format_table(summary: list[dict], base: dict) -> str:
    header = ["recipe", "steps", "prediction val loss", "Δ vs single continued", "Δ vs single, equal compute"]
    header += ["share of depth up-scaling's gain", "Δ vs base", "primary Δ vs single continued", "trainable params"]
    header.append("train tok/s (wall / CPU)")
    rows = [["base (pretrained)", "-", f"{base['mean']:.4f}"] + ["-"] * 7]
    for entry in summary:
        loss = entry["aux_val_loss"] or entry["primary_val_loss"]
        share = entry["share_of_depth_upscaling_gain"]
        # a dual recipe compared with the single one of its own learning rate says so
        against = entry["single_continued"].removeprefix(BASELINE)
        against = f" (vs{against})" if against else ""
        rows.append(
            [
                entry["name"],
                str(entry["steps"] or "-"),
                format_error(loss, sign=False),
                format_error(entry["prediction_vs_single_continued"]) + against,
                format_error(entry["prediction_vs_single_equal_compute"]),
                format_share(share["ratio"], share["se"]) if share else "-",
                format_error(entry["prediction_vs_base"]),
                format_error(entry["primary_vs_single_continued"]) + against,
                f"{entry['trainable_params']:,}",
                f"{entry['tokens_per_s']:.0f} / {entry['tokens_per_cpu_s']:.0f}",
            ]
        )
    return text_table(header, rows)


def previous_upcycle(path: Path, scale: TinyScale, continue_steps: int, data: dict) -> tuple[dict, dict]:
    """
    ({seed: {"base": ..., recipe name: run}}, the report) of an earlier upcycle report made the same way; ({}, {})
    where there is none yet (a study of several base lengths resumed before it reached this one).
    """
    if not path.exists():
        return {}, {}
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


def upcycle_report(args, scale, continue_steps, recipes, out: Path, corpus, num_seeds: int, jobs: int) -> dict:
    """Every seed's missing recipe runs for one base length, merged with --out's earlier ones; writes upcycle.json."""
    train_tokens, val_blocks, data = corpus
    out.mkdir(parents=True, exist_ok=True)
    earlier, previous = previous_upcycle(out / "upcycle.json", scale, continue_steps, data) if args.resume else ({}, {})
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
    summary = summarize([recipe for recipe in RECIPES if recipe.name in names], per_seed, scale)
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
        f"ran ({len(per_seed)} at most); equal compute: the single-flow model continued for the recipe's training "
        f"FLOPs; pretrain {scale.steps} steps, continue {continue_steps} steps. "
        f"Total {report['wall_s_total'] / 60:.1f} min."
    )
    return report


COMPARISONS = {"prediction_vs_single_continued": "equal tokens", "prediction_vs_single_equal_compute": "equal compute"}


def base_length_trend(reports: list[dict]) -> list[dict]:
    """
    Per dual recipe and comparison (equal tokens / equal compute) found at every base length: the paired gain per
    base, and a line fitted per seed (gain on log2 base steps, on the seeds every base has): its slope per doubling of
    the base's length and its value at the longest base, mean ± SE over the seeds, and how many doublings past the
    longest base the mean line reaches 0 when it heads there (an extrapolation).
    """
    steps = [report["pretrain_steps"] for report in reports]
    entries = [{entry["name"]: entry for entry in report["recipes"]} for report in reports]
    rows = []
    for name in entries[0]:
        for key, comparison in COMPARISONS.items():
            gains = [by_name.get(name, {}).get(key) for by_name in entries]
            if entries[0][name]["aux_factor"] is None or None in gains:
                continue
            row = {"recipe": name, "comparison": comparison, "vs": [gain.get("vs") for gain in gains]}
            row["by_base"] = [{"base_steps": n, **without_seeds(gain)} for n, gain in zip(steps, gains)]
            seeds = sorted(set.intersection(*(set(gain["by_seed"]) for gain in gains)))
            xs = [math.log2(n) for n in steps]
            if len(steps) < 2 or not seeds:
                row["slope_per_doubling"] = row["at_longest_base"] = row["doublings_to_zero"] = None
            else:
                fits = [statistics.linear_regression(xs, [gain["by_seed"][seed] for gain in gains]) for seed in seeds]
                row["slope_per_doubling"] = mean_and_error([fit.slope for fit in fits])
                row["at_longest_base"] = mean_and_error([fit.intercept + fit.slope * max(xs) for fit in fits])
                slope, at_longest = row["slope_per_doubling"]["mean"], row["at_longest_base"]["mean"]
                heads_to_zero = slope != 0 and (at_longest < 0) == (slope > 0)
                row["doublings_to_zero"] = -at_longest / slope if heads_to_zero else None
            rows.append(row)
    return rows


def without_seeds(gain: dict) -> dict:
    return {key: value for key, value in gain.items() if key != "by_seed"}


def format_trend_table(rows: list[dict], steps: list[int]) -> str:
    header = ["recipe", "Δ vs single at"] + [f"base {n}" for n in steps]
    header += ["slope per doubling of the base", "fitted at the longest base", "fitted 0 after"]
    lines = []
    for row in rows:
        zero = row["doublings_to_zero"]
        lines.append(
            [row["recipe"], row["comparison"]]
            + [format_error(gain) for gain in row["by_base"]]
            + [
                format_error(row["slope_per_doubling"]),
                format_error(row["at_longest_base"]),
                "-" if zero is None else f"{zero:.1f} more doublings (extrapolated)",
            ]
        )
    return text_table(header, lines)


def run_upcycle(args, scale: TinyScale, num_seeds: int, jobs: int) -> int:
    """
    Pretrain `scale.steps` (or each of `--base-steps`, a folder each), continue `--continue-steps` (default half the
    scale's steps, the same for every base); the options were checked by `experiment.run`.
    """
    continue_steps = args.continue_steps or max(1, scale.steps // 2)
    if continue_steps < 1:
        raise DualFlowUserError(f"--continue-steps must be >= 1, got {continue_steps}")
    recipes = select_recipes(args.arms)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DualFlowUserError(f"--out {out} exists and is not a folder")
    corpus = load_corpus(args.data, scale)
    disable_progress_bar()  # transformers' per-load weight bars, dozens per seed
    if not args.base_steps:
        upcycle_report(args, scale, continue_steps, recipes, out, corpus, num_seeds, jobs)
        print_footer([out / "upcycle.json"], args.quick)
        return 0
    steps = sorted(set(args.base_steps))
    written, reports = [], []
    for base_steps in steps:  # each base length's report is complete before the next starts
        written.append(out / f"base-{base_steps}" / "upcycle.json")
        print(f"\nbase pretrained {base_steps} steps:")
        base_scale = with_steps(scale, base_steps)
        reports.append(
            upcycle_report(args, base_scale, continue_steps, recipes, written[-1].parent, corpus, num_seeds, jobs)
        )
    trend = base_length_trend(reports)
    summary = {
        "schema": BASE_LENGTH_SCHEMA,
        "command": command_line(args),
        "base_steps": steps,
        "continue_steps": continue_steps,
        "reports": [str(path.relative_to(out)) for path in written],
        "trend": trend,
        "table": format_trend_table(trend, steps),
    }
    written.append(out / "base_length.json")
    written[-1].write_text(json.dumps(summary, indent=1))
    print(f"\n{summary['table']}")
    print(
        "Δ: the dual recipe's prediction minus the single-flow model continued for the same tokens / training FLOPs, "
        "paired by seed; the line is fitted per seed on log2(base steps), ± = standard error over the seeds."
    )
    print_footer(written, args.quick)
    return 0
