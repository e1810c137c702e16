"""The report of `dualflow experiment`: the JSON (read back for --resume), per-arm summaries, the studies, tables."""

import json
import math
import shlex
import statistics
from dataclasses import asdict
from pathlib import Path

from ..errors import DualFlowUserError
from .arms import BASELINE, DESIGN_REFERENCE, SIZE_STUDY, TOKEN_BUDGETS, TOKEN_STUDY, arm_costs, budget_name
from .scale import TinyScale
from .stats import depth_gain_share, format_error, mean_and_error, paired_differences, ratio_and_error
from .tables import text_table


SCHEMA = "dualflow-experiment/2"
DEPTH_SHARE_TARGET = 0.75  # token study: a design's share of 2x depth's gain at some budget


def made_the_same_way(previous: dict, schema: str, scale: TinyScale, data: dict) -> bool:
    """Whether an earlier report has `schema` and was made with `scale` on the same data (for --resume)."""
    same_data = all(previous["data"][key] == data[key] for key in ("source", "files", "val_tokens"))
    return previous.get("schema") == schema and previous["scale"] == asdict(scale) and same_data


def previous_runs(path: Path, scale: TinyScale, data: dict) -> tuple[dict, dict]:
    """(runs by arm name, the report) of an earlier report at `path` made with the same scale and data, for --resume."""
    previous = json.loads(path.read_text())
    if not made_the_same_way(previous, SCHEMA, scale, data):
        raise DualFlowUserError(f"--resume: {path} was made with another scale, data or schema; use another --out")
    return {arm["name"]: arm["runs"] for arm in previous["arms"]}, previous


def summarize(arms, scale: TinyScale, results: dict) -> list[dict]:
    """
    Per arm: costs, val loss over seeds, the paired difference to the single-flow k2 arm of its size with its SE, the
    share of that size's 2x-depth gain, and for design variants the paired difference to the paper's design.
    """
    summary = []
    for arm in arms:
        runs = sorted(results[arm.name], key=lambda run: run["seed"])
        if not runs:
            continue
        baseline_runs, depth_runs = results.get(arm.baseline_name, []), results.get(arm.depth_name)
        entry = {"name": arm.name, "role": arm.role, "dual": arm.dual, "config": dict(arm.config)}
        entry |= {"training": dict(arm.training), **arm_costs(arm, scale)}
        entry["val_loss"] = mean_and_error([run["val_loss"] for run in runs])
        entry["primary_val_loss"] = mean_and_error([run["primary_val_loss"] for run in runs]) if arm.dual else None
        for key in ("tokens_per_s", "tokens_per_cpu_s"):  # runs resumed from an older report may lack CPU seconds
            values = [run[key] for run in runs if key in run]
            entry[key] = statistics.median(values) if values else None
        for key in ("val_loss", "primary_val_loss") if arm.dual else ("val_loss",):
            deltas = list(paired_differences(runs, baseline_runs, key).values())
            entry[f"{key}_delta"] = {"vs": arm.baseline_name, **mean_and_error(deltas)} if deltas else None
        entry["depth_gain_share"] = (
            depth_gain_share(runs, baseline_runs, depth_runs) if arm.dual and depth_runs else None
        )
        # A design variant replaces the paper's design only if it beats it, paired by seed, by 2 standard errors.
        design_deltas = list(paired_differences(runs, results.get(DESIGN_REFERENCE, [])).values())
        entry["val_loss_delta_vs_design_reference"] = (
            {"vs": DESIGN_REFERENCE, **mean_and_error(design_deltas)}
            if arm.role.startswith("design") and design_deltas
            else None
        )
        entry["runs"] = runs
        summary.append(entry)
    return summary


def size_study(summary: list[dict], scale: TinyScale) -> list[dict]:
    """Per hidden size with runs of every arm of `SIZE_STUDY`: their paired gains and the dual designs' depth shares."""
    by_name = {entry["name"]: entry for entry in summary}
    sizes = {scale.hidden_size: ""} | {
        entry["training"]["hidden_size"]: f" h{entry['training']['hidden_size']}"
        for entry in summary
        if "hidden_size" in entry["training"]
    }
    rows = []
    for hidden, suffix in sorted(sizes.items()):
        entries = {role: by_name.get(name + suffix) for role, name in SIZE_STUDY.items()}
        if None in entries.values():
            continue
        row = {"hidden_size": hidden, "baseline_val_loss": entries["baseline"]["val_loss"]}
        row["depth_delta"] = entries["depth"]["val_loss_delta"]
        for role in ("paper design", "best design"):
            row[role] = {
                "delta": entries[role]["val_loss_delta"],
                "depth_gain_share": entries[role]["depth_gain_share"],
            }
        rows.append(row)
    return rows


def iso_token_ratio(loss: float, baseline_curve: list[tuple[float, float]]) -> tuple[float, bool]:
    """
    How many tokens the baseline needs to reach `loss`, from its (log2 tokens, loss) points: linear in log tokens
    between neighbouring budgets, the nearest segment extended outside them. Returns (log2 tokens, extrapolated).
    """
    points = sorted(baseline_curve)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if min(y0, y1) <= loss <= max(y0, y1) and y0 != y1:
            return x0 + (loss - y0) * (x1 - x0) / (y1 - y0), False
    (x0, y0), (x1, y1) = points[:2] if loss > points[0][1] else points[-2:]
    return x0 + (loss - y0) * (x1 - x0) / (y1 - y0), True


def token_study(summary: list[dict], results: dict, scale: TinyScale) -> list[dict]:
    """
    Per token budget with runs of every `TOKEN_STUDY` arm: 2x depth's and each dual design's paired gain over the
    single k2 of the same budget, the design's share of 2x depth's gain, and its iso-token ratio: how many times its
    budget the baseline needs to reach the design's loss, interpolated per seed on the baseline's own loss curve over
    the budgets. A design's retention is its gain at a budget over its gain at 1x (paired by seed).
    """
    by_name = {entry["name"]: entry for entry in summary}
    budgets = [f for f in (1, *TOKEN_BUDGETS) if all(budget_name(n, f) in by_name for n in TOKEN_STUDY.values())]
    if len(budgets) < 2:
        return []
    tokens_per_step = scale.batch_size * scale.block_size
    baseline_losses = {
        f: {run["seed"]: run["val_loss"] for run in results[budget_name(BASELINE.name, f)]} for f in budgets
    }
    seeds_on_curve = set.intersection(*(set(losses) for losses in baseline_losses.values()))
    rows = []
    for factor in budgets:
        names = {role: budget_name(name, factor) for role, name in TOKEN_STUDY.items()}
        baseline_runs, depth_runs = results[names["baseline"]], results[names["depth"]]
        row = {
            "token_factor": factor,
            "train_tokens": scale.steps * factor * tokens_per_step,
            "baseline_val_loss": by_name[names["baseline"]]["val_loss"],
            "baseline_tokens_per_cpu_s": by_name[names["baseline"]]["tokens_per_cpu_s"],
            "depth_delta": mean_and_error(list(paired_differences(depth_runs, baseline_runs).values())),
        }
        for role in ("new model default", "best design"):
            runs = results[names[role]]
            gains = paired_differences(runs, baseline_runs)
            at_1x = paired_differences(results[budget_name(TOKEN_STUDY[role], 1)], results[BASELINE.name])
            curve_points = {
                run["seed"]: iso_token_ratio(
                    run["val_loss"], [(math.log2(f), baseline_losses[f][run["seed"]]) for f in budgets]
                )
                for run in runs
                if run["seed"] in seeds_on_curve
            }
            row[role] = {
                "name": names[role],
                "delta": mean_and_error(list(gains.values())) if gains else None,
                "depth_gain_share": depth_gain_share(runs, baseline_runs, depth_runs, DEPTH_SHARE_TARGET),
                "retention_vs_1x": ratio_and_error(gains, at_1x) if factor > 1 else None,
                "iso_token_ratio": mean_and_error([2**x / factor for x, _ in curve_points.values()])
                if curve_points
                else None,
                "iso_token_ratio_extrapolated": any(flag for _, flag in curve_points.values()),
                "tokens_per_cpu_s": by_name[names[role]]["tokens_per_cpu_s"],
            }
        rows.append(row)
    return rows


def format_token_table(rows: list[dict]) -> str:
    header = ["tokens", "single k2 val loss", "2x depth Δ"]
    for role in ("new model default", "best design"):
        header += [f"{role} Δ", "share of 2x depth", "gain kept vs 1x", "iso-token ratio"]
    header.append("train CPU-s per token (x single k2: default / best)")
    lines = []
    for row in rows:
        line = [
            f"{row['token_factor']}x ({row['train_tokens'] / 1e6:.2f}M)",
            format_error(row["baseline_val_loss"], sign=False),
        ]
        line.append(format_error(row["depth_delta"]))
        costs = []
        for role in ("new model default", "best design"):
            design = row[role]
            kept = design["retention_vs_1x"]
            ratio = design["iso_token_ratio"]
            line += [
                format_error(design["delta"]),
                format_share(*depth_share(design)),
                "-" if kept is None else format_share(kept["ratio"], kept["se"]),
                "-"
                if ratio is None
                else format_error(ratio, digits=2, sign=False)
                + (" (extrapolated)" if design["iso_token_ratio_extrapolated"] else ""),
            ]
            costs.append(f"{row['baseline_tokens_per_cpu_s'] / design['tokens_per_cpu_s']:.2f}")
        line.append(" / ".join(costs))
        lines.append(line)
    return text_table(header, lines)


def format_share(share: float | None, se: float | None) -> str:
    """ "62% ± 9%" ("-" for None)."""
    return "-" if share is None else f"{share:.0%} ± {se:.0%}"


def format_table(arms: list[dict]) -> str:
    header = [
        "arm",
        "val loss (mean ± SE)",
        "Δ vs single k2 of its size (paired ± SE)",
        "primary flow Δ",
        "share of 2x-depth gain (± SE)",
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
                f"{format_share(share['share'], share['share_se'])} ({share['verdict']} 60%)" if share else "-",
                format_error(arm.get("val_loss_delta_vs_design_reference")),
                f"{arm['tokens_per_s']:.0f} / "
                + (f"{arm['tokens_per_cpu_s']:.0f}" if arm["tokens_per_cpu_s"] else "-"),
                str(arm["prefill_experts_per_token"]),
                str(arm["decode_experts_per_token"]),
            ]
        )
    return text_table(header, rows)


def depth_share(design: dict) -> tuple:
    """(share, its SE) of a size-study design's 2x-depth gain, (None, None) without one."""
    share = design["depth_gain_share"]
    return (share["share"], share["share_se"]) if share else (None, None)


def format_size_table(rows: list[dict]) -> str:
    header = ["hidden", "single k2 val loss", "2x depth Δ", "paper design Δ", "share", "best design Δ", "share"]
    lines = []
    for row in rows:
        paper, best = row["paper design"], row["best design"]
        lines.append(
            [
                str(row["hidden_size"]),
                format_error(row["baseline_val_loss"], sign=False),
                format_error(row["depth_delta"]),
                format_error(paper["delta"]),
                format_share(*depth_share(paper)),
                format_error(best["delta"]),
                format_share(*depth_share(best)),
            ]
        )
    return text_table(header, lines)


def command_line(args) -> str:
    parts = ["dualflow", "experiment"] + (["--quick"] if args.quick else []) + (["--resume"] if args.resume else [])
    if args.regime != "scratch":
        parts += ["--regime", args.regime]
    options = (("--seeds", args.seeds), ("--steps", args.steps), ("--continue-steps", args.continue_steps))
    for flag, value in options + (("--jobs", args.jobs),):
        if value is not None:
            parts += [flag, str(value)]
    if args.base_steps:
        parts += ["--base-steps", *map(str, args.base_steps)]
    for flag, values in (("--data", args.data), ("--arms", args.arms)):
        if values:
            parts += [flag] + [shlex.quote(str(value)) for value in values]
    return " ".join(parts + ["--out", shlex.quote(str(args.out))])


def print_footer(written: list[Path], quick: bool) -> None:
    """What was written, and the --quick warning: the last lines of both regimes."""
    print(f"wrote {', '.join(map(str, written))}")
    if quick:
        print("--quick: far too few steps to conclude anything; run without --quick for the real comparison.")
