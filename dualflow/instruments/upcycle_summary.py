"""
The upcycling regime's report: per recipe, the losses over seeds and their differences paired by seed (to the
single-flow model continued for the same tokens or training FLOPs, to the base, as a share of depth up-scaling's
gain), the table, the earlier report `--resume` reads back, and the trend of the gain with the base's length.
"""

import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from ..errors import DualFlowUserError
from .report import format_share, made_the_same_way
from .scale import TinyScale
from .stats import format_error, mean_and_error, paired_differences, ratio_and_error
from .tables import text_table
from .upcycle_recipes import BASELINE, DEPTH_UPSCALED, RECIPES_BY_NAME, recipe_train_flops_per_token


SCHEMA = "dualflow-upcycle/1"
BASE_LENGTH_SCHEMA = "dualflow-upcycle-base-length/1"


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
