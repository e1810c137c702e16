"""
The recipes of `dualflow experiment --regime upcycle`: every way of continuing the converted base as data, the groups
`--arms` picks from, and the steps an equal-compute recipe takes (by the experiment's FLOPs formula).
"""

from dataclasses import dataclass, replace

from ..errors import DualFlowUserError
from .arms import arm_costs, dual, single
from .scale import TinyScale


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
