"""`dualflow experiment`: a CPU-scale check of the paper's claims, training tiny byte-level MoE LMs from scratch.

Every arm uses the same data, the same token budget (except the arm that doubles it on purpose) and the same seeds; a
seed fixes both the initial shared weights and the order of batches, so differences to the baseline are paired by
seed. Single-flow arms are the same model class trained with the aux flow off. An arm is data: a name, the
`DualFlowConfig` fields it changes and how its training differs, so a new config field becomes an arm in one line.
"""

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling_dualflow import DualFlowConfig

from ..errors import DualFlowUserError
from ..scoring import mean_token_nll, mean_token_nlls
from .data import check_data_files, read_byte_tokens, split_files, spread_blocks, stdlib_source_files
from .tables import text_table
from .tiny_lm import TinyScale, tiny_moe_config, train_language_model


SCHEMA = "dualflow-experiment/2"
# The recipe of the independent prototype (/work/shared/EXPERIMENT_NOTES.md), calibrated in docs/results/README.md:
# PyTorch's default init (transformers' N(0, 0.02) hurt the aux flow there), AdamW 2e-3, cosine to 10%, 0.01 balance.
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
DEFAULT_SEEDS = 6
MAX_TRAIN_TOKENS = 20_000_000
DESIGN_KEYS = {"coupling_form", "aux_final_norm"}  # apply_aux_design's arguments


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

    def missing_config_fields(self) -> list[str]:
        """Config fields this version of `DualFlowConfig` does not know (it would silently keep them as extras)."""
        known = DualFlowConfig().to_dict()
        return [key for key in self.config if key not in known]

    def model_config(self, scale: TinyScale) -> DualFlowConfig:
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


def dual(top_k: int, aux_top_k: int, suffix: str = "", role: str = "", training=None, **config) -> Arm:
    name = f"dual kp{top_k} ka{aux_top_k}" + (f" {suffix}" if suffix else "")
    fields = {"num_experts_per_tok": top_k, "aux_num_experts_per_tok": aux_top_k, "use_aux_flow": True, **config}
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
    dual(2, 4, "r2", "aux flow runs 2 rounds through the layers (issue 13)", aux_num_rounds=2),
    dual(2, 4, "r3", "aux flow runs 3 rounds through the layers (issue 13)", aux_num_rounds=3),
    # Design study of the aux flow (issue 11 item 3): each changes one thing of dual kp2 ka4.
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
        "design: 2 rounds, the extra round's gate starting at 1 instead of 0 (issue 13)",
        aux_num_rounds=2,
        aux_round_gate_init=1.0,
    ),
    dual(
        2,
        4,
        "r3 gate 1",
        "design: 3 rounds, the extra rounds' gates starting at 1 (issue 13)",
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
FRACTION_ARMS = (
    *(
        dual(
            2,
            4,
            f"{BEST_SUFFIX} f{f}",
            f"fraction: the best design, aux flow trained at a random {f:.1%} of positions",
            **BEST_DESIGN,
            aux_train_fraction=f,
        )
        for f in (0.5, 0.25, 0.125)
    ),
    dual(
        2,
        4,
        f"{BEST_SUFFIX} f0.25 last",
        "fraction: the best design, aux flow trained at the last 25% of positions",
        **BEST_DESIGN,
        aux_train_fraction=0.25,
        aux_train_positions="last",
    ),
    dual(
        2,
        4,
        "r2 gate 1 aux emb copied f0.25 plw 2",
        "fraction: the best design at a random 25%, primary weight 0.5 / 0.25 (the aux CE weighed by f, rescaled)",
        **(BEST_DESIGN | {"primary_loss_weight": 2.0}),
        aux_train_fraction=0.25,
    ),
    dual(
        2,
        4,
        "aux emb copied f0.25",
        "fraction: one round, aux embedding copied, a random 25% of positions",
        aux_embed_init="copy",
        aux_train_fraction=0.25,
    ),
)
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
ARMS = ARMS + FRACTION_ARMS + SIZE_ARMS
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
    "fraction": ("single k2",) + tuple(arm.name for arm in FRACTION_ARMS),
    "size": ("single k2",) + tuple(arm.name for arm in SIZE_ARMS),
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
    rounds = getattr(config, "aux_num_rounds", 1) if aux else 1
    return 2 * d * config.vocab_size + rounds * layers


def arm_costs(arm: Arm, scale: TinyScale) -> dict:
    """Analytic per-token costs of an arm: training / prefill / decode FLOPs, routed experts (summed over layers)."""
    config = arm.model_config(scale)
    top_k, aux_top_k = config.num_experts_per_tok, config.aux_num_experts_per_tok
    train_ctx, moe_layers = (scale.block_size + 1) / 2, sum(map(config.is_moe_layer, range(config.num_hidden_layers)))
    prefill = flow_forward_flops(config, train_ctx, top_k)
    train_forward, decode, decode_experts = prefill, flow_forward_flops(config, scale.block_size, top_k), top_k
    if arm.dual:
        rounds = getattr(config, "aux_num_rounds", 1)
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


def mean_and_error(values: list[float]) -> dict:
    """Mean, sample std, standard error of the mean (std / sqrt(n)), n, min, max."""
    n = len(values)
    std = statistics.stdev(values) if n > 1 else None  # one value has no spread
    return {
        "mean": statistics.fmean(values),
        "std": std,
        "se": std / math.sqrt(n) if n > 1 else None,
        "n": n,
        "min": min(values),
        "max": max(values),
    }


def paired_differences(runs: list[dict], baseline_runs: list[dict], key: str = "val_loss") -> dict[int, float]:
    """{seed: run[key] - baseline val_loss} for the seeds both have (same seed = same batches, same initial weights)."""
    baseline = {run["seed"]: run["val_loss"] for run in baseline_runs}
    return {run["seed"]: run[key] - baseline[run["seed"]] for run in runs if run["seed"] in baseline}


def depth_gain_share(runs: list[dict], baseline_runs: list[dict], depth_runs: list[dict], target: float = 0.6) -> dict:
    """
    How much of the 2x-depth gain an arm closes, on the seeds all three share: the ratio of the mean paired gains, and
    the paired test of the target, per seed (arm - baseline) - target * (depth - baseline): reached when that is
    below 0 by 2 standard errors, missed when above 0 by 2, undecided otherwise.
    """
    gains, depth_gains = paired_differences(runs, baseline_runs), paired_differences(depth_runs, baseline_runs)
    seeds = sorted(set(gains) & set(depth_gains))
    if len(seeds) < 2:
        return None
    share = statistics.fmean(gains[s] for s in seeds) / statistics.fmean(depth_gains[s] for s in seeds)
    test = mean_and_error([gains[s] - target * depth_gains[s] for s in seeds])
    verdict = (
        "reached" if test["mean"] < -2 * test["se"] else "missed" if test["mean"] > 2 * test["se"] else "undecided"
    )
    return {"share": share, "target": target, "arm_minus_target": test, "verdict": verdict}


def load_corpus(data_paths, scale: TinyScale) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """
    (train tokens, validation blocks, description): split by file; a single file is split 90/10 by position. The
    validation blocks are spread evenly over all validation files and are the same for every arm and seed.
    """
    files = check_data_files(data_paths) if data_paths else stdlib_source_files()
    train_files, val_files = split_files(files)
    train = read_byte_tokens(train_files, max_tokens=MAX_TRAIN_TOKENS)
    if val_files:
        blocks, files_hit = spread_blocks(val_files, scale.block_size, scale.eval_blocks)
    else:
        cut = int(len(train) * 0.9)
        train, val = train[:cut], train[cut:]
        num_blocks = min(scale.eval_blocks, len(val) // scale.block_size)
        if num_blocks == 0:
            raise DualFlowUserError(
                f"validation data holds {len(val)} tokens, fewer than one block of {scale.block_size}"
            )
        blocks, files_hit = val[: num_blocks * scale.block_size].view(num_blocks, -1).long(), 0
    if len(train) <= scale.block_size:
        raise DualFlowUserError(
            f"training data holds {len(train)} tokens, need more than a block of {scale.block_size}"
        )
    description = {
        "source": "--data files" if data_paths else f"Python {platform.python_version()} standard library sources",
        "files": len(files),
        "train_files": len(train_files),
        "val_files": len(val_files) or "last 10% of the single file",
        "val_files_with_a_block": files_hit,
        "train_tokens_available": len(train),
        "val_blocks": len(blocks),
        "val_tokens": blocks.numel(),
        "val_sampling": "blocks at evenly spaced offsets over the concatenated validation files",
        "tokenization": "byte-level (UTF-8 bytes, vocab 256)",
    }
    return train, blocks, description


_WORKER_DATA: dict = {}


def _init_worker(train_tokens, val_blocks, threads):
    torch.set_num_threads(threads)
    _WORKER_DATA.update(train=train_tokens, val=val_blocks)


def train_and_score(arm: Arm, scale: TinyScale, seed: int, train_tokens=None, val_blocks=None) -> dict:
    """One run: train `arm` from scratch with `seed`, score its prediction (and its primary flow) on the blocks."""
    train_tokens = _WORKER_DATA["train"] if train_tokens is None else train_tokens
    val_blocks = _WORKER_DATA["val"] if val_blocks is None else val_blocks
    arm_scale, steps = arm.scale(scale), arm.steps(scale)
    start, cpu_start = time.perf_counter(), time.process_time()
    model, curve = train_language_model(
        arm.model_config(scale),
        train_tokens,
        arm_scale,
        seed,
        steps=steps,
        show_progress=False,
        aux_design={key: value for key, value in arm.training.items() if key in DESIGN_KEYS},
    )
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = steps * scale.batch_size * scale.block_size
    # CPU seconds too: on a shared machine the wall clock also counts other processes' turns.
    run = {"seed": seed, "train_s": train_s, "train_cpu_s": cpu_s, "tokens_per_s": tokens / train_s}
    run["tokens_per_cpu_s"] = tokens / cpu_s
    if arm.dual:  # one pass scores both flows: the primary logits come with the prediction
        losses = mean_token_nlls(model, val_blocks, ("logits", "primary_logits"), batch_size=32, use_aux_flow=True)
        run["val_loss"], run["primary_val_loss"] = losses["logits"], losses["primary_logits"]
    else:
        run["val_loss"], run["primary_val_loss"] = mean_token_nll(model, val_blocks, 32, use_aux_flow=False), None
    run["train_curve"] = curve
    return run


def run_arms(arms, scale, seeds, train_tokens, val_blocks, jobs=1, threads=1, done=None, on_run=None):
    """
    Train every arm for every seed it has no run for in `done` ({arm name: runs}), `jobs` runs at a time in their own
    processes (`threads` torch threads each), in seed-major order, so an interrupted run still covers every arm.
    `on_run(results)` sees the results after each finished run. Returns {arm name: runs}, `done` included.
    """
    results = {name: list(runs) for name, runs in (done or {}).items()}
    for arm in arms:
        results.setdefault(arm.name, [])
    tasks = [(arm, seed) for seed in seeds for arm in arms if seed not in {run["seed"] for run in results[arm.name]}]
    with tqdm(total=len(tasks), desc="runs") as bar:

        def finished(arm, run):
            results[arm.name].append(run)
            if on_run is not None:
                on_run(results)
            bar.set_postfix_str(f"{arm.name} seed {run['seed']}: val {run['val_loss']:.4f}")
            bar.update()

        if jobs == 1:
            torch.set_num_threads(threads)
            for arm, seed in tasks:
                finished(arm, train_and_score(arm, scale, seed, train_tokens, val_blocks))
        else:
            context = get_context("fork")  # workers share the loaded modules and data; torch resets its pools at fork
            with context.Pool(jobs, _init_worker, (train_tokens, val_blocks, threads), maxtasksperchild=None) as pool:
                pending = [(arm, pool.apply_async(train_and_score, (arm, scale, seed))) for arm, seed in tasks]
                for arm, result in pending:
                    finished(arm, result.get())
    return results


def previous_runs(path: Path, scale: TinyScale, data: dict) -> tuple[dict, dict]:
    """(runs by arm name, the report) of an earlier report at `path` made with the same scale and data, for --resume."""
    previous = json.loads(path.read_text())
    same_data = all(previous["data"][key] == data[key] for key in ("source", "files", "val_tokens"))
    if previous.get("schema") != SCHEMA or previous["scale"] != asdict(scale) or not same_data:
        raise DualFlowUserError(f"--resume: {path} was made with another scale, data or schema; use another --out")
    return {arm["name"]: arm["runs"] for arm in previous["arms"]}, previous


def summarize(arms, scale: TinyScale, results: dict) -> list[dict]:
    """Per arm: costs, val loss over seeds, the paired difference to the baseline (the first arm) with its SE."""
    summary = []
    baseline_runs = results[arms[0].name]
    depth_runs = results.get(DEPTH_ARM)
    for arm in arms:
        runs = sorted(results[arm.name], key=lambda run: run["seed"])
        if not runs:
            continue
        entry = {"name": arm.name, "role": arm.role, "dual": arm.dual, "config": dict(arm.config)}
        entry |= {"training": dict(arm.training), **arm_costs(arm, scale)}
        entry["val_loss"] = mean_and_error([run["val_loss"] for run in runs])
        entry["primary_val_loss"] = mean_and_error([run["primary_val_loss"] for run in runs]) if arm.dual else None
        for key in ("tokens_per_s", "tokens_per_cpu_s"):  # runs resumed from an older report may lack CPU seconds
            values = [run[key] for run in runs if key in run]
            entry[key] = statistics.median(values) if values else None
        for key in ("val_loss", "primary_val_loss") if arm.dual else ("val_loss",):
            deltas = list(paired_differences(runs, baseline_runs, key).values())
            entry[f"{key}_delta"] = {"vs": arms[0].name, **mean_and_error(deltas)} if deltas else None
        entry["depth_gain_share"] = (
            depth_gain_share(runs, baseline_runs, depth_runs) if arm.dual and depth_runs else None
        )
        # A design variant replaces today's default only if it beats it, paired by seed, by 2 standard errors.
        design_deltas = list(paired_differences(runs, results.get(DESIGN_REFERENCE, [])).values())
        entry["val_loss_delta_vs_design_reference"] = (
            {"vs": DESIGN_REFERENCE, **mean_and_error(design_deltas)}
            if arm.role.startswith("design") and design_deltas
            else None
        )
        entry["runs"] = runs
        summary.append(entry)
    return summary


def format_error(stats: dict | None, digits: int = 4, sign: bool = True) -> str:
    """ "mean ± SE" of a `mean_and_error` dict ("-" for None, the mean alone for one value)."""
    if stats is None:
        return "-"
    mean = f"{stats['mean']:+.{digits}f}" if sign else f"{stats['mean']:.{digits}f}"
    return mean if stats["n"] < 2 else f"{mean} ± {stats['se']:.{digits}f}"


def format_table(arms: list[dict]) -> str:
    header = [
        "arm",
        "val loss (mean ± SE)",
        "Δ vs first arm (paired ± SE)",
        "primary flow Δ",
        "share of 2x-depth gain",
        f"design: Δ vs {DESIGN_REFERENCE}",
        "train tok/s (wall / CPU)",
        "prefill experts/tok",
        "decode experts/tok",
    ]
    rows = []
    for arm in arms:
        share = arm.get("depth_gain_share")
        rows.append(
            [
                arm["name"],
                format_error(arm["val_loss"], sign=False),
                format_error(arm["val_loss_delta"]),
                format_error(arm.get("primary_val_loss_delta")),
                f"{share['share']:.0%} ({share['verdict']} 60%)" if share else "-",
                format_error(arm.get("val_loss_delta_vs_design_reference")),
                f"{arm['tokens_per_s']:.0f} / "
                + (f"{arm['tokens_per_cpu_s']:.0f}" if arm["tokens_per_cpu_s"] else "-"),
                str(arm["prefill_experts_per_token"]),
                str(arm["decode_experts_per_token"]),
            ]
        )
    return text_table(header, rows)


def _smooth(values: list[float], window: int) -> list[float]:
    cumulative, out = [0.0], []
    for value in values:
        cumulative.append(cumulative[-1] + value)
    for i in range(len(values)):
        lo = max(0, i + 1 - window)
        out.append((cumulative[i + 1] - cumulative[lo]) / (i + 1 - lo))
    return out


def arm_color(index: int):
    """Distinct colours for up to 20 arms (the design study has more than matplotlib's default cycle of 10)."""
    import matplotlib

    return matplotlib.colormaps["tab20"](index % 20)


def plot_loss_curves(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = report["scale"]
    tokens_per_step = scale["batch_size"] * scale["block_size"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lowest = []
    for index, arm in enumerate(report["arms"]):
        mean_curve = [statistics.fmean(step) for step in zip(*(run["train_curve"] for run in arm["runs"]))]
        smoothed = _smooth(mean_curve, window=max(1, len(mean_curve) // 25))
        lowest.append(min(smoothed))
        x = [(step + 1) * tokens_per_step / 1e6 for step in range(len(mean_curve))]
        style = "--" if arm["dual"] else "-"
        ax.plot(x, smoothed, style, color=arm_color(index), label=f"{arm['name']} (val {arm['val_loss']['mean']:.3f})")
    ax.set(xlabel="training tokens (millions)", ylabel="training NLL of the prediction (nats/token, smoothed)")
    ax.set_ylim(min(lowest) - 0.1, min(lowest) + 1.5)
    ax.set_title(
        f"Training curves, mean of {len(report['seeds'])} seed(s); dashed = dual-flow (aux prediction)", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(report: dict, path) -> None:
    """Paired Δ val loss vs the baseline (± SE) against prefill, decode and training cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prefill_flops_per_token", "prefill cost (MFLOP / prompt token)"),
        ("decode_flops_per_token", "decode cost (MFLOP / generated token)"),
        ("train_flops_total", "training cost (total TFLOP)"),
    ]
    legend_rows = -(-len(report["arms"]) // 4)  # the legend below the panels: 4 arms per row
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2 + 0.2 * legend_rows), sharey=True)
    label_points = len(report["arms"]) <= 10  # beyond that the names overlap: the legend alone says which is which
    for ax, (key, label) in zip(axes, panels):
        divisor = 1e12 if key == "train_flops_total" else 1e6
        for index, arm in enumerate(report["arms"]):
            delta = arm["val_loss_delta"]
            x, se = arm[key] / divisor, delta["se"] if delta["n"] > 1 else 0.0
            marker = "s" if arm["dual"] else "o"
            color = arm_color(index)
            ax.errorbar(x, delta["mean"], yerr=se, fmt=marker, color=color, capsize=3, markersize=7, label=arm["name"])
            if label_points:
                ax.annotate(
                    arm["name"], (x, delta["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=7, color=color
                )
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"Δ validation loss vs {report['arms'][0]['name']} (nats/token; paired mean ± SE)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Cost vs quality: lower-left is better (squares = dual-flow)", fontsize=11)
    fig.tight_layout(rect=(0, 0.035 * legend_rows + 0.02, 1, 1))  # room for the legend
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(args) -> str:
    parts = ["dualflow", "experiment"] + (["--quick"] if args.quick else []) + (["--resume"] if args.resume else [])
    if args.regime != "scratch":
        parts += ["--regime", args.regime]
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--jobs", args.jobs)):
        if value is not None:
            parts += [flag, str(value)]
    for flag, values in (("--data", args.data), ("--arms", args.arms)):
        if values:
            parts += [flag] + [shlex.quote(str(value)) for value in values]
    return " ".join(parts + ["--out", shlex.quote(str(args.out))])


def select_arms(names) -> tuple[list[Arm], list[str]]:
    """(arms to run, names left out because the model lacks their config fields); the baseline always comes first."""
    names = names or ["default"]
    chosen = []
    for name in names:
        for member in ARM_GROUPS.get(name, (name,)):
            if member not in ARMS_BY_NAME:
                raise DualFlowUserError(
                    f"unknown arm {member!r}; arms: {', '.join(ARMS_BY_NAME)}; groups: {', '.join(ARM_GROUPS)}"
                )
            if member not in chosen:
                chosen.append(member)
    arms, skipped = [], []
    for name in [BASELINE.name] + [name for name in chosen if name != BASELINE.name]:
        missing = ARMS_BY_NAME[name].missing_config_fields()
        if not missing:
            arms.append(ARMS_BY_NAME[name])
        elif name in names:  # asked for by name: say why it cannot run
            raise DualFlowUserError(
                f"arm {name!r} needs DualFlowConfig fields this version lacks: {', '.join(missing)}"
            )
        else:
            skipped.append(name)
    return arms, skipped


def build_parser(prog: str = "dualflow experiment") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run of a few seconds per arm (too short to conclude anything)"
    )
    parser.add_argument(
        "--regime",
        choices=("scratch", "upcycle"),
        default="scratch",
        help="scratch: every arm trained from scratch (default); upcycle: pretrain single-flow, save as Qwen3-MoE, "
        "convert, continue each recipe for the same tokens",
    )
    parser.add_argument("--data", nargs="+", help="text files (default: the Python standard library sources)")
    parser.add_argument("--seeds", type=int, help=f"seeds per arm (default {DEFAULT_SEEDS}; --quick: 2)")
    parser.add_argument("--steps", type=int, help="training steps per arm (the 2x-tokens arm runs twice as many)")
    parser.add_argument(
        "--arms",
        nargs="+",
        metavar="ARM",
        help=f"arms or groups ({', '.join(ARM_GROUPS)}; default: default). Arms: {', '.join(repr(n) for n in ARMS_BY_NAME)}",
    )
    parser.add_argument("--out", default="runs/experiment", help="output folder (default runs/experiment)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs of --out/experiment.json (same scale and data) and train only the missing arm/seed runs",
    )
    parser.add_argument("--jobs", type=int, help="runs trained at once, each in its own process (default: CPU count)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads per run (default 1: these matmuls are too small to gain from more)",
    )
    return parser


def run(args) -> int:
    scale = QUICK_SCALE if args.quick else DEFAULT_SCALE
    if args.steps is not None:
        if args.steps < 1:
            raise DualFlowUserError(f"--steps must be >= 1, got {args.steps}")
        scale = replace(scale, steps=args.steps, warmup_steps=min(scale.warmup_steps, args.steps))
    num_seeds = args.seeds if args.seeds is not None else (2 if args.quick else DEFAULT_SEEDS)
    if num_seeds < 1:
        raise DualFlowUserError(f"--seeds must be >= 1, got {num_seeds}")
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    if jobs < 1 or args.threads < 1:
        raise DualFlowUserError(f"--jobs and --threads must be >= 1, got {jobs} and {args.threads}")
    if args.regime == "upcycle":
        from .upcycle import run_upcycle  # imports the converter and PEFT, which the default regime does not need

        return run_upcycle(args, scale, num_seeds, jobs)
    arms, skipped = select_arms(args.arms)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DualFlowUserError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)

    train_tokens, val_blocks, data = load_corpus(args.data, scale)
    done, previous = previous_runs(out / "experiment.json", scale, data) if args.resume else ({}, {})
    # The report covers every arm with runs (this invocation's and earlier ones'), in the order of ARMS.
    names = {arm.name for arm in arms} | {name for name, runs in done.items() if runs and name in ARMS_BY_NAME}
    report_arms = [arm for arm in ARMS if arm.name in names]
    report = {
        "schema": SCHEMA,
        "command": command_line(args),
        "commands": previous.get("commands", [previous["command"]] if previous else []) + [command_line(args)],
        "quick": args.quick,
        "scale": asdict(scale),
        "data": data,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "jobs": jobs,
            "torch_threads_per_job": args.threads,
            "python": platform.python_version(),
        },
        "flops_formula": FLOPS_FORMULA,
        "arms_left_out": skipped,
    }
    started, earlier_wall_s = time.perf_counter(), previous.get("wall_s_total", 0.0)

    def save(results, complete=False):
        report["complete"] = complete
        report["wall_s_total"] = earlier_wall_s + time.perf_counter() - started
        report["seeds"] = sorted({run["seed"] for runs in results.values() for run in runs})
        report["arms"] = summarize(report_arms, scale, results)
        report["table"] = format_table(report["arms"])
        (out / "experiment.json").write_text(json.dumps(report, indent=1))

    def on_run(results):  # a partial report after every run: a long run that is cut short keeps its results
        if results[BASELINE.name]:
            save(results)

    seeds = list(range(num_seeds))
    results = run_arms(arms, scale, seeds, train_tokens, val_blocks, jobs, args.threads, done, on_run)
    save(results, complete=True)
    plot_loss_curves(report, out / "loss_curves.png")
    plot_frontier(report, out / "frontier.png")
    print(report["table"])
    print(
        f"val loss: mean next-token NLL of the prediction (aux flow for dual arms) over {data['val_tokens']} held-out "
        f"tokens; Δ: paired by seed, ± = standard error over {num_seeds} seed(s). "
        f"Total {report['wall_s_total'] / 60:.1f} min."
    )
    print_footer(skipped, [out / "experiment.json", out / "loss_curves.png", out / "frontier.png"], args.quick)
    return 0


def print_footer(skipped: list[str], written: list[Path], quick: bool) -> None:
    """What was left out, what was written, and the --quick warning: the last lines of both regimes."""
    if skipped:
        print(f"left out (this model version lacks their config fields): {', '.join(skipped)}")
    print(f"wrote {', '.join(map(str, written))}")
    if quick:
        print("--quick: far too few steps to conclude anything; run without --quick for the real comparison.")
