"""The report of `dualflow experiment`: the JSON (read back for --resume), per-arm summaries, the studies, tables."""

import json
import shlex
import statistics
from dataclasses import asdict
from pathlib import Path

from ..errors import DualFlowUserError
from .arms import BASELINE, DESIGN_REFERENCE, FRACTION_REFERENCE, SIZE_STUDY, arm_costs
from .scale import TinyScale
from .stats import depth_gain_share, format_error, mean_and_error, paired_differences, ratio_and_error
from .tables import text_table


SCHEMA = "dualflow-experiment/2"
COST_TARGET = 1.3  # training cost per token of a fraction arm, in single-flow k2 units
GAIN_TARGET = 0.9  # share of the same design's gain at every position


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


def fraction_study(summary: list[dict], results: dict) -> list[dict]:
    """
    Per arm trained at a fraction of the positions: its gains, the share of the same design's gain at every position,
    and its training cost per token in single-flow k2 units (measured CPU seconds and analytic FLOPs).
    """
    by_name = {entry["name"]: entry for entry in summary}
    baseline = by_name.get(BASELINE.name)
    rows = []
    for name, reference in FRACTION_REFERENCE.items():
        if name not in by_name or reference not in by_name or baseline is None:
            continue
        entry = by_name[name]
        gains = paired_differences(results[name], results[BASELINE.name])
        reference_gains = paired_differences(results[reference], results[BASELINE.name])
        share = ratio_and_error(gains, reference_gains)
        cost = baseline["tokens_per_cpu_s"] / entry["tokens_per_cpu_s"]
        flops = entry["train_flops_per_token"] / baseline["train_flops_per_token"]
        rows.append(
            {
                "name": name,
                "fraction": entry["config"]["aux_train_fraction"],
                "positions": entry["config"].get("aux_train_positions", "random"),
                "reference": reference,
                "delta": entry["val_loss_delta"],
                "primary_delta": entry["primary_val_loss_delta"],
                "share_of_reference_gain": share,
                "train_cost_cpu": cost,
                "train_cost_flops": flops,
                "reference_train_cost_cpu": baseline["tokens_per_cpu_s"] / by_name[reference]["tokens_per_cpu_s"],
                "wins": bool(share and share["ratio"] >= GAIN_TARGET and cost <= COST_TARGET),
            }
        )
    return rows


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


def format_fraction_table(rows: list[dict]) -> str:
    header = ["arm", "Δ vs single k2", "primary Δ", "share of its f=1 gain", "train cost (CPU / FLOPs, x k2)"]
    lines = []
    for row in rows:
        share = row["share_of_reference_gain"] or {"ratio": None, "se": None}
        lines.append(
            [
                row["name"],
                format_error(row["delta"]),
                format_error(row["primary_delta"]),
                format_share(share["ratio"], share["se"]),
                f"{row['train_cost_cpu']:.2f} / {row['train_cost_flops']:.2f}",
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
    for flag, values in (("--data", args.data), ("--arms", args.arms)):
        if values:
            parts += [flag] + [shlex.quote(str(value)) for value in values]
    return " ".join(parts + ["--out", shlex.quote(str(args.out))])


def print_footer(written: list[Path], quick: bool) -> None:
    """What was written, and the --quick warning: the last lines of both regimes."""
    print(f"wrote {', '.join(map(str, written))}")
    if quick:
        print("--quick: far too few steps to conclude anything; run without --quick for the real comparison.")
