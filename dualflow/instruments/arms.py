"""
The arms of `dualflow experiment`: the scales, every arm as data (a name, the `DualFlowConfig` fields it changes and
how its training differs, so a new config field becomes an arm in one line), the groups and the analytic cost model.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import DualFlowUserError
from .scale import TinyScale


if TYPE_CHECKING:
    from modeling_dualflow import DualFlowConfig


# The recipe of an independent prototype of the same equations, calibrated in the project's published results: PyTorch's
# default init (transformers' N(0, 0.02) hurt the aux flow there), AdamW 2e-3, cosine to 10%, 0.01 balance.
DEFAULT_SCALE = replace(
    TinyScale(),
    hidden_size=96,
    num_hidden_layers=3,
    moe_intermediate_size=96,
    batch_size=8,
    steps=900,
    learning_rate=2e-3,
    warmup_steps=50,
    eval_blocks=1024,
    weight_decay=0.05,
    adam_beta2=0.999,
    router_aux_loss_coef=0.01,
    init="torch",
)
QUICK_SCALE = replace(
    DEFAULT_SCALE,
    hidden_size=32,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    block_size=32,
    batch_size=4,
    steps=20,
    warmup_steps=2,
    eval_blocks=32,
)
DESIGN_KEYS = {"coupling_form", "aux_final_norm"}  # apply_aux_design's arguments


def with_steps(scale: TinyScale, steps: int) -> TinyScale:
    """`scale` trained for `steps` steps (its warmup cut to fit)."""
    return replace(scale, steps=steps, warmup_steps=min(scale.warmup_steps, steps))


def budget_suffix(token_factor: int) -> str:
    """ " {f}x tokens" for f > 1 times the scale's tokens, else "": what an arm's name adds for its token budget."""
    return f" {token_factor}x tokens" if token_factor > 1 else ""


def budget_name(name: str, token_factor: int) -> str:
    """The arm `name` (its 1x name) trained on `token_factor` x the scale's tokens."""
    return name + budget_suffix(token_factor)


@dataclass(frozen=True)
class Arm:
    """
    One model to train. `config`: `DualFlowConfig` fields over the scale's (top-k, aux flow on, ...). `training`:
    `depth_factor` (x layers), `token_factor` (x steps), a design variant (`DESIGN_KEYS`, see
    `aux_design.apply_aux_design`), or any `TinyScale` field (e.g. `init`).
    """

    name: str
    config: Mapping = field(default_factory=dict)
    training: Mapping = field(default_factory=dict)
    role: str = ""

    @property
    def dual(self) -> bool:
        return bool(self.config.get("use_aux_flow"))

    @property
    def size_suffix(self) -> str:
        """ " h{hidden}" for an arm of the size study (another hidden size than the scale's), else ""."""
        return f" h{self.training['hidden_size']}" if "hidden_size" in self.training else ""

    @property
    def tokens_suffix(self) -> str:
        """ " {f}x tokens" for an arm trained on f > 1 times the scale's tokens, else ""."""
        return budget_suffix(self.training.get("token_factor", 1))

    @property
    def baseline_name(self) -> str:
        """
        The single-flow k2 arm this arm's gains are paired against: the one of its own size and token budget. The
        budget's baseline itself is paired against the baseline at 1x (what the extra tokens buy).
        """
        budget_baseline = BASELINE.name + self.size_suffix + self.tokens_suffix
        return BASELINE.name + self.size_suffix if self.name == budget_baseline else budget_baseline

    @property
    def depth_name(self) -> str:
        """The 2x-depth arm of its own size and token budget (the gain a share is measured against)."""
        return DEPTH_ARM + self.size_suffix + self.tokens_suffix

    def model_config(self, scale: TinyScale) -> "DualFlowConfig":
        from .tiny_lm import tiny_moe_config  # torch loads when an arm runs, not for `--help`

        config = dict(self.config)
        top_k = config.pop("num_experts_per_tok", 2)
        aux_top_k = config.pop("aux_num_experts_per_tok", top_k) if config.pop("use_aux_flow", False) else None
        return tiny_moe_config(self.scale(scale), top_k, aux_top_k, self.training.get("depth_factor", 1), **config)

    def scale(self, scale: TinyScale) -> TinyScale:
        return replace(
            scale, **{key: value for key, value in self.training.items() if key in TinyScale.__dataclass_fields__}
        )

    def steps(self, scale: TinyScale) -> int:
        return scale.steps * self.training.get("token_factor", 1)


def single(top_k: int, name: str | None = None, role: str = "", **training) -> Arm:
    return Arm(name or f"single k{top_k}", {"num_experts_per_tok": top_k}, training, role)


# An arm's name says what it changes of the paper's design (an aux embedding of its own, closed round gates), which a
# new model's defaults no longer are: each dual arm states those fields.
PAPER_DESIGN = {"aux_embed_init": "independent", "aux_round_gate_init": 0.0}


def dual(top_k: int, aux_top_k: int, suffix: str = "", role: str = "", training=None, **config) -> Arm:
    name = f"dual kp{top_k} ka{aux_top_k}" + (f" {suffix}" if suffix else "")
    fields = {"num_experts_per_tok": top_k, "aux_num_experts_per_tok": aux_top_k, "use_aux_flow": True}
    fields |= PAPER_DESIGN | config
    return Arm(name, fields, training or {}, role)


BASELINE = single(2, role="baseline")
ARMS = (
    BASELINE,
    single(4, role="more compute in prefill and decode"),
    single(2, "single k2 2x depth", "twice the layers: 2x prefill, 2x KV cache, 2x parameters", depth_factor=2),
    single(2, "single k2 2x tokens", "twice the training tokens", token_factor=2),
    dual(2, 2, role="regime 1 and 2: aux flow at equal top-k"),
    dual(2, 4, role="regime 1: more decode compute, same prefill"),
    dual(1, 3, role="regime 2: 4 experts split 1+3"),
    dual(3, 1, role="regime 2: 4 experts split 3+1"),
    dual(2, 4, "r2", "aux flow runs 2 rounds through the layers", aux_num_rounds=2),
    dual(2, 4, "r3", "aux flow runs 3 rounds through the layers", aux_num_rounds=3),
    # Design study of the aux flow: each changes one thing of dual kp2 ka4.
    dual(2, 4, "init 0.02", "design: transformers' N(0, 0.02) init", {"init": "model"}, initializer_range=0.02),
    dual(2, 4, "aux emb copied", "design: aux embedding starts as the primary's", aux_embed_init="copy"),
    dual(2, 4, "plw 0.5", "design: primary_loss_weight 0.5", primary_loss_weight=0.5),
    dual(2, 4, "plw 2", "design: primary_loss_weight 2", primary_loss_weight=2.0),
    dual(2, 4, "coupling normed", "design: gain on the normed primary state", {"coupling_form": "normed gain"}),
    dual(
        2, 4, "coupling rank 8", "design: gain + a rank-8 map of the primary state", {"coupling_form": "gain + rank 8"}
    ),
    dual(2, 4, "aux final norm", "design: the aux rows' own final norm", {"aux_final_norm": True}),
    dual(
        2,
        4,
        "r2 gate 1",
        "design: 2 rounds, the extra round's gate starting at 1 instead of 0",
        aux_num_rounds=2,
        aux_round_gate_init=1.0,
    ),
    dual(
        2,
        4,
        "r3 gate 1",
        "design: 3 rounds, the extra rounds' gates starting at 1",
        aux_num_rounds=3,
        aux_round_gate_init=1.0,
    ),
    dual(
        2,
        4,
        "r2 gate 1 aux emb copied",
        "design: the two winners together",
        aux_num_rounds=2,
        aux_round_gate_init=1.0,
        aux_embed_init="copy",
    ),
    dual(
        2,
        4,
        "aux emb copied plw 0.5",
        "design: one-round winners together",
        aux_embed_init="copy",
        primary_loss_weight=0.5,
    ),
    dual(
        2,
        4,
        "r2 gate 1 aux emb copied plw 0.5",
        "design: every winner together",
        aux_num_rounds=2,
        aux_round_gate_init=1.0,
        aux_embed_init="copy",
        primary_loss_weight=0.5,
    ),
    dual(
        2,
        4,
        "r3 gate 1 aux emb copied plw 0.5",
        "design: every winner together, 3 rounds",
        aux_num_rounds=3,
        aux_round_gate_init=1.0,
        aux_embed_init="copy",
        primary_loss_weight=0.5,
    ),
)
BEST_DESIGN = {"aux_num_rounds": 2, "aux_round_gate_init": 1.0, "aux_embed_init": "copy", "primary_loss_weight": 0.5}
BEST_SUFFIX = "r2 gate 1 aux emb copied plw 0.5"
SIZE_ARMS = tuple(
    arm
    for hidden in (64, 144)
    for arm in (
        single(
            2,
            f"single k2 h{hidden}",
            f"size: baseline at hidden {hidden}",
            hidden_size=hidden,
            moe_intermediate_size=hidden,
        ),
        single(
            2,
            f"single k2 2x depth h{hidden}",
            f"size: 2x depth at hidden {hidden}",
            depth_factor=2,
            hidden_size=hidden,
            moe_intermediate_size=hidden,
        ),
        dual(
            2,
            4,
            f"h{hidden}",
            f"size: the paper's design at hidden {hidden}",
            {"hidden_size": hidden, "moe_intermediate_size": hidden},
        ),
        dual(
            2,
            4,
            f"{BEST_SUFFIX} h{hidden}",
            f"size: the best design at hidden {hidden}",
            {"hidden_size": hidden, "moe_intermediate_size": hidden},
            **BEST_DESIGN,
        ),
    )
)
# The token-scaling study: the baseline, 2x depth, a new model's default and the best design, each trained on 2x and
# 4x the scale's tokens (the 1x arms are the ones above; "single k2 2x tokens" is the 2x baseline).
TOKEN_BUDGETS = (2, 4)
TOKEN_STUDY = {  # role: the arm at 1x; at f x tokens the arm named name + " {f}x tokens"
    "baseline": BASELINE.name,
    "depth": "single k2 2x depth",
    "new model default": "dual kp2 ka4 aux emb copied",
    "best design": f"dual kp2 ka4 {BEST_SUFFIX}",
}
TOKEN_ARMS = tuple(
    arm
    for factor in TOKEN_BUDGETS
    for arm in (
        single(2, f"single k2 {factor}x tokens", f"tokens: {factor}x the training tokens", token_factor=factor),
        single(
            2,
            f"single k2 2x depth {factor}x tokens",
            f"tokens: 2x depth on {factor}x the training tokens",
            depth_factor=2,
            token_factor=factor,
        ),
        dual(
            2,
            4,
            f"aux emb copied {factor}x tokens",
            f"tokens: a new model's default on {factor}x the training tokens",
            {"token_factor": factor},
            aux_embed_init="copy",
        ),
        dual(
            2,
            4,
            f"{BEST_SUFFIX} {factor}x tokens",
            f"tokens: the best design on {factor}x the training tokens",
            {"token_factor": factor},
            **BEST_DESIGN,
        ),
    )
    if arm.name != "single k2 2x tokens"  # in ARMS already
)
ARMS = ARMS + SIZE_ARMS + TOKEN_ARMS
ARMS_BY_NAME = {arm.name: arm for arm in ARMS}
DEPTH_ARM = "single k2 2x depth"
DESIGN_REFERENCE = "dual kp2 ka4"  # today's default, which each design variant changes in one way
# The default run: the baseline, both known-better arms, 2x tokens, regime 1 (2/2, 2/4) and regime 2 (1/3, 2/2, 3/1);
# the rounds arms join as soon as the model has `aux_num_rounds`. `--arms all` runs every arm.
DEFAULT_ARMS = (
    "single k2",
    "single k4",
    "single k2 2x depth",
    "dual kp2 ka4",
    "dual kp2 ka4 r2",
    "dual kp2 ka2",
    "dual kp1 ka3",
    "dual kp3 ka1",
    "single k2 2x tokens",
)  # in the order a seed runs them: the comparisons that answer the main questions first
ARM_GROUPS = {
    "default": DEFAULT_ARMS,
    "all": tuple(ARMS_BY_NAME),
    "design": ("single k2", "single k2 2x depth", "dual kp2 ka4")
    + tuple(arm.name for arm in ARMS if arm.role.startswith("design")),
    "size": ("single k2",) + tuple(arm.name for arm in SIZE_ARMS),
    # seed-major runs go cheapest budget first, so a run cut short still has whole budgets
    "tokens": tuple(TOKEN_STUDY.values())
    + tuple(budget_name(name, factor) for factor in TOKEN_BUDGETS for name in TOKEN_STUDY.values()),
}


FLOPS_FORMULA = (
    "Matmul FLOPs (2 per multiply-add) per token, per layer: q,o projections 2*d*2*q_dim; k,v projections "
    "2*d*2*kv_dim (primary flow only: the aux flow reads the primary K/V); attention 2*2*ctx*q_dim (scores and "
    "weighted sum over ctx keys); router 2*d*E; experts top_k*2*3*d*I; plus the LM head 2*d*V per flow. The aux flow "
    "counts its layers once per round (aux_num_rounds). Training uses ctx=(T+1)/2 (causal average over a block of T) "
    "and aux rows at every position, and counts 3x the forward (backward = 2x forward). Prefill = primary flow at "
    "ctx=(T+1)/2; decode = primary (+ aux for dual-flow) at ctx=T. Norms, softmax, RoPE and embeddings are left out."
)


def flow_forward_flops(config, context: float, top_k: int, aux: bool = False) -> float:
    """Forward FLOPs per token of one flow (see FLOPS_FORMULA)."""
    d, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layers = 0
    for layer_idx in range(config.num_hidden_layers):
        layers += 2 * d * 2 * q_dim + (0 if aux else 2 * d * 2 * kv_dim) + 2 * 2 * context * q_dim
        if config.is_moe_layer(layer_idx):
            layers += 2 * d * config.num_experts + top_k * 2 * 3 * d * config.moe_intermediate_size
        else:
            layers += 2 * 3 * d * config.intermediate_size
    rounds = config.aux_num_rounds if aux else 1
    return 2 * d * config.vocab_size + rounds * layers


def arm_costs(arm: Arm, scale: TinyScale) -> dict:
    """Analytic per-token costs of an arm: training / prefill / decode FLOPs, routed experts (summed over layers)."""
    config = arm.model_config(scale)
    top_k, aux_top_k = config.num_experts_per_tok, config.aux_num_experts_per_tok
    train_ctx, moe_layers = (scale.block_size + 1) / 2, sum(map(config.is_moe_layer, range(config.num_hidden_layers)))
    prefill = flow_forward_flops(config, train_ctx, top_k)
    train_forward, decode, decode_experts = prefill, flow_forward_flops(config, scale.block_size, top_k), top_k
    if arm.dual:
        rounds = config.aux_num_rounds
        train_forward += flow_forward_flops(config, train_ctx, aux_top_k, aux=True)
        decode += flow_forward_flops(config, scale.block_size, aux_top_k, aux=True)
        decode_experts += rounds * aux_top_k
    train_tokens = arm.steps(scale) * scale.batch_size * scale.block_size
    return {
        "top_k": top_k,
        "aux_top_k": aux_top_k if arm.dual else None,
        "num_hidden_layers": config.num_hidden_layers,
        "train_tokens": train_tokens,
        "train_flops_per_token": 3 * train_forward,
        "train_flops_total": 3 * train_forward * train_tokens,
        "prefill_flops_per_token": prefill,
        "decode_flops_per_token": decode,
        "prefill_experts_per_token": top_k * moe_layers,
        "decode_experts_per_token": decode_experts * moe_layers,
        "kv_cache_layers": config.num_hidden_layers,
    }


def select_arms(names) -> list[Arm]:
    """The arms and groups `names` ask for (default: the default group); the baseline always comes first."""
    chosen = [BASELINE.name]
    for name in names or ["default"]:
        for member in ARM_GROUPS.get(name, (name,)):
            if member not in ARMS_BY_NAME:
                raise DualFlowUserError(
                    f"unknown arm {member!r}; arms: {', '.join(ARMS_BY_NAME)}; groups: {', '.join(ARM_GROUPS)}"
                )
            if member not in chosen:
                chosen.append(member)
    return [ARMS_BY_NAME[name] for name in chosen]


SIZE_STUDY = {  # the arms the size study compares at each size: baseline, 2x depth, the paper's design, the best one
    "baseline": BASELINE.name,
    "depth": DEPTH_ARM,
    "paper design": "dual kp2 ka4",
    "best design": f"dual kp2 ka4 {BEST_SUFFIX}",
}
