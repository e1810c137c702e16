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

This module runs the seeds and writes the reports; the recipes are in `upcycle_recipes`, the models they continue in
`upcycle_models`, one seed's runs in `upcycle_runner` and the summaries and tables in `upcycle_summary`.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path

from transformers.utils.logging import disable_progress_bar

from ..errors import DualFlowUserError
from .arms import with_steps
from .report import command_line, print_footer
from .runner import fork_pool, load_corpus
from .stats import mean_and_error
from .tiny_lm import TinyScale
from .upcycle_recipes import RECIPES, select_recipes
from .upcycle_runner import upcycle_seed
from .upcycle_summary import (
    BASE_LENGTH_SCHEMA,
    SCHEMA,
    base_length_trend,
    format_table,
    format_trend_table,
    previous_upcycle,
    summarize,
)


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
