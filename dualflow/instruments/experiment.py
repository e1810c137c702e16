"""`dualflow experiment`: a CPU-scale check of the paper's claims, training tiny byte-level MoE LMs from scratch.

Every arm uses the same data, the same token budget (except the arm that doubles it on purpose) and the same seeds; a
seed fixes both the initial shared weights and the order of batches, so differences to the baseline are paired by
seed. Single-flow arms are the same model class trained with the aux flow off. An arm is data: a name, the
`DualFlowConfig` fields it changes and how its training differs, so a new config field becomes an arm in one line.
"""

import argparse
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import DualFlowUserError
from .arms import (
    ARM_GROUPS,
    ARMS,
    ARMS_BY_NAME,
    BASELINE,
    DEFAULT_SCALE,
    FLOPS_FORMULA,
    QUICK_SCALE,
    select_arms,
    with_steps,
)
from .plots import plot_depth_share_vs_size, plot_frontier, plot_loss_curves, plot_token_scaling, pyplot
from .report import (
    SCHEMA,
    command_line,
    format_size_table,
    format_table,
    format_token_table,
    previous_runs,
    print_footer,
    size_study,
    summarize,
    token_study,
)


DEFAULT_SEEDS = 6


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
        "convert, continue each recipe for the same tokens (or, equal-compute recipes, the same training FLOPs)",
    )
    parser.add_argument("--data", nargs="+", help="text files (default: the Python standard library sources)")
    parser.add_argument("--seeds", type=int, help=f"seeds per arm (default {DEFAULT_SEEDS}; --quick: 2)")
    parser.add_argument("--steps", type=int, help="training steps per arm (the 2x-tokens arm runs twice as many)")
    parser.add_argument(
        "--continue-steps",
        type=int,
        help="upcycle: steps each recipe continues after conversion (default: half of --steps, the pretraining's)",
    )
    parser.add_argument(
        "--base-steps",
        type=int,
        nargs="+",
        metavar="N",
        help="upcycle: pretrain bases of each of these lengths (instead of --steps), each base's report in "
        "--out/base-N, and fit the trend of each dual recipe's gain with the base's length (--out/base_length.json)",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        metavar="ARM",
        help=f"arms or groups ({', '.join(ARM_GROUPS)}; default: default), e.g. 'dual kp2 ka4'; an unknown name is "
        f"refused with the list of the {len(ARMS_BY_NAME)} arms. With --regime upcycle: recipes or groups (default, lr, "
        "gentle, compute, rounds, all)",
    )
    parser.add_argument("--out", default="runs/experiment", help="output folder (default runs/experiment)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs of --out/experiment.json (upcycle: upcycle.json, each base's with --base-steps) made with the "
        "same scale and data, and train only the missing arm/seed runs",
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
        scale = with_steps(scale, args.steps)
    num_seeds = args.seeds if args.seeds is not None else (2 if args.quick else DEFAULT_SEEDS)
    if num_seeds < 1:
        raise DualFlowUserError(f"--seeds must be >= 1, got {num_seeds}")
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    if jobs < 1 or args.threads < 1:
        raise DualFlowUserError(f"--jobs and --threads must be >= 1, got {jobs} and {args.threads}")
    for flag, value in (("--continue-steps", args.continue_steps), ("--base-steps", args.base_steps)):
        if value is not None and args.regime != "upcycle":
            raise DualFlowUserError(f"{flag} applies to --regime upcycle only")
    if args.base_steps is not None and (args.steps is not None or min(args.base_steps) < 1):
        raise DualFlowUserError(f"--base-steps takes lengths >= 1 in place of --steps, got {args.base_steps}")
    if args.regime == "upcycle":
        from .upcycle import run_upcycle  # imports the converter and PEFT, which the default regime does not need

        return run_upcycle(args, scale, num_seeds, jobs)
    pyplot()  # fails now, not after every run has trained, when matplotlib (the `instruments` extra) is missing
    import torch  # here, not at the top: `--help` and argument errors need no torch

    from .runner import load_corpus, run_arms

    arms = select_arms(args.arms)
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
    }
    started, earlier_wall_s = time.perf_counter(), previous.get("wall_s_total", 0.0)

    def save(results, complete=False):
        report["complete"] = complete
        report["wall_s_total"] = earlier_wall_s + time.perf_counter() - started
        report["seeds"] = sorted({run["seed"] for runs in results.values() for run in runs})
        report["arms"] = summarize(report_arms, scale, results)
        report["table"] = format_table(report["arms"])
        report["size_study"] = size_study(report["arms"], scale)
        report["size_table"] = format_size_table(report["size_study"])
        report["token_study"] = token_study(report["arms"], results, scale)
        report["token_table"] = format_token_table(report["token_study"])
        (out / "experiment.json").write_text(json.dumps(report, indent=1))

    def on_run(results):  # a partial report after every run: a long run that is cut short keeps its results
        if results[BASELINE.name]:
            save(results)

    seeds = list(range(num_seeds))
    results = run_arms(arms, scale, seeds, train_tokens, val_blocks, jobs, args.threads, done, on_run)
    save(results, complete=True)
    written = [out / "experiment.json", out / "loss_curves.png", out / "frontier.png"]
    plot_loss_curves(report, written[1])
    plot_frontier(report, written[2])
    if len(report["size_study"]) > 1:
        written.append(out / "depth_share_vs_size.png")
        plot_depth_share_vs_size(report["size_study"], written[-1])
    if report["token_study"]:
        written.append(out / "token_scaling.png")
        plot_token_scaling(report, written[-1])
    print(report["table"])
    for table in ("size_table", "token_table"):
        if report[table.replace("table", "study")]:
            print(f"\n{report[table]}")
    print(
        f"val loss: mean next-token NLL of the prediction (aux flow for dual arms) over {data['val_tokens']} held-out "
        f"tokens; Δ: paired by seed, ± = standard error over {num_seeds} seed(s). "
        f"Total {report['wall_s_total'] / 60:.1f} min."
    )
    print_footer(written, args.quick)
    return 0
