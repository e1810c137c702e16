"""`dualflow experiment`: a CPU-scale check of the paper's claims, training tiny byte-level MoE LMs from scratch.

Every arm uses the same data, the same token budget (except the arm that doubles it on purpose) and the same seeds; a
seed fixes both the initial weights and the order of batches. Single-flow arms are the same model class trained with
the aux flow off.
"""

import json
import platform
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import DualFlowUserError
from .data import check_data_files, eval_blocks, read_byte_tokens, split_files, stdlib_source_files
from .tiny_lm import TinyScale, mean_token_nll, tiny_moe_config, train_language_model


SCHEMA = "dualflow-experiment/1"
DEFAULT_SCALE = TinyScale()
QUICK_SCALE = replace(TinyScale(), block_size=64, batch_size=8, steps=50, warmup_steps=5, eval_blocks=16)
MAX_TRAIN_TOKENS = 20_000_000


@dataclass(frozen=True)
class Arm:
    """One model to train: top-k of each flow (aux_top_k None = single flow), depth and token multipliers."""

    name: str
    top_k: int
    aux_top_k: int | None = None
    depth_factor: int = 1
    token_factor: int = 1
    role: str = ""

    @property
    def dual(self) -> bool:
        return self.aux_top_k is not None


ARMS = (
    Arm("single k2", 2, role="baseline"),
    Arm("single k4", 4, role="more compute in prefill and decode"),
    Arm("dual kp2 ka2", 2, 2, role="aux flow at equal top-k"),
    Arm("dual kp2 ka4", 2, 4, role="regime 1: more decode compute, same prefill"),
    Arm("dual kp1 ka3", 1, 3, role="regime 2: 4 experts split 1+3"),
    Arm("dual kp3 ka1", 3, 1, role="regime 2: 4 experts split 3+1"),
    Arm("single k2 2x depth", 2, depth_factor=2, role="compute-matched: twice the layers"),
    Arm("single k2 2x tokens", 2, token_factor=2, role="compute-matched: twice the training tokens"),
)

FLOPS_FORMULA = (
    "Matmul FLOPs (2 per multiply-add) per token, per layer: q,o projections 2*d*2*q_dim; k,v projections "
    "2*d*2*kv_dim (primary flow only: the aux flow reads the primary K/V); attention 2*2*ctx*q_dim (scores and "
    "weighted sum over ctx keys); router 2*d*E; experts top_k*2*3*d*I; plus the LM head 2*d*V per flow. Training "
    "uses ctx=(T+1)/2 (causal average over a block of T) and aux rows at every position, and counts "
    "3x the forward (backward = 2x forward). Prefill = primary flow at ctx=(T+1)/2; decode = primary (+ aux for "
    "dual-flow) at ctx=T. Norms, softmax, RoPE and embeddings are left out."
)


def flow_forward_flops(config, context: float, top_k: int, aux: bool = False) -> float:
    """Forward FLOPs per token of one flow (see FLOPS_FORMULA)."""
    d, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    total = 2 * d * config.vocab_size
    for layer_idx in range(config.num_hidden_layers):
        total += 2 * d * 2 * q_dim + (0 if aux else 2 * d * 2 * kv_dim) + 2 * 2 * context * q_dim
        if config.is_moe_layer(layer_idx):
            total += 2 * d * config.num_experts + top_k * 2 * 3 * d * config.moe_intermediate_size
        else:
            total += 2 * 3 * d * config.intermediate_size
    return total


def arm_costs(arm: Arm, config, scale: TinyScale) -> dict:
    """Analytic per-token costs of an arm: training / prefill / decode FLOPs, routed experts (summed over layers)."""
    train_ctx, moe_layers = (scale.block_size + 1) / 2, sum(map(config.is_moe_layer, range(config.num_hidden_layers)))
    train_forward = flow_forward_flops(config, train_ctx, arm.top_k)
    decode = flow_forward_flops(config, scale.block_size, arm.top_k)
    if arm.dual:
        train_forward += flow_forward_flops(config, train_ctx, arm.aux_top_k, aux=True)
        decode += flow_forward_flops(config, scale.block_size, arm.aux_top_k, aux=True)
    train_tokens = scale.steps * arm.token_factor * scale.batch_size * scale.block_size
    return {
        "train_tokens": train_tokens,
        "train_flops_per_token": 3 * train_forward,
        "train_flops_total": 3 * train_forward * train_tokens,
        "prefill_flops_per_token": flow_forward_flops(config, train_ctx, arm.top_k),
        "decode_flops_per_token": decode,
        "prefill_experts_per_token": arm.top_k * moe_layers,
        "decode_experts_per_token": (arm.top_k + (arm.aux_top_k or 0)) * moe_layers,
        "kv_cache_layers": config.num_hidden_layers,
    }


def _mean_spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def load_corpus(data_paths, scale: TinyScale) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train tokens, validation blocks, description): split by file; a single file is split 90/10 by position."""
    files = check_data_files(data_paths) if data_paths else stdlib_source_files()
    train_files, val_files = split_files(files)
    train = read_byte_tokens(train_files, max_tokens=MAX_TRAIN_TOKENS)
    if val_files:
        val = read_byte_tokens(val_files, max_tokens=scale.eval_blocks * scale.block_size)
    else:
        cut = int(len(train) * 0.9)
        train, val = train[:cut], train[cut:]
    if len(train) <= scale.block_size:
        raise DualFlowUserError(
            f"training data holds {len(train)} tokens, need more than a block of {scale.block_size}"
        )
    blocks = eval_blocks(val, scale.block_size, scale.eval_blocks)
    description = {
        "source": "--data files" if data_paths else f"Python {platform.python_version()} standard library sources",
        "files": len(files),
        "train_files": len(train_files),
        "val_files": len(val_files) or "last 10% of the single file",
        "train_tokens_available": len(train),
        "val_tokens": blocks.numel(),
        "tokenization": "byte-level (UTF-8 bytes, vocab 256)",
    }
    return train, blocks, description


def run_arms(arms, scale: TinyScale, seeds: list[int], train_tokens, val_blocks, show_progress=True) -> list[dict]:
    """Train every arm for every seed (seed-major, so an interrupted run still covers all arms); one dict per arm."""
    results = {arm.name: {"runs": []} for arm in arms}
    with tqdm(total=len(arms) * len(seeds), desc="runs", disable=not show_progress) as bar:
        for seed in seeds:
            for arm in arms:
                config = tiny_moe_config(scale, arm.top_k, arm.aux_top_k, arm.depth_factor)
                start = time.perf_counter()
                model, curve = train_language_model(
                    config,
                    train_tokens,
                    scale,
                    seed,
                    steps=scale.steps * arm.token_factor,
                    desc=f"{arm.name} (seed {seed})",
                    show_progress=show_progress,
                )
                wall = time.perf_counter() - start
                run = {"seed": seed, "wall_s": wall, "train_curve": curve}
                run["val_loss"] = mean_token_nll(model, val_blocks, use_aux_flow=arm.dual)
                run["primary_val_loss"] = mean_token_nll(model, val_blocks, use_aux_flow=False) if arm.dual else None
                results[arm.name]["runs"].append(run)
                bar.set_postfix_str(f"{arm.name}: val {run['val_loss']:.3f}")
                bar.update()
    summary = []
    for arm in arms:
        config = tiny_moe_config(scale, arm.top_k, arm.aux_top_k, arm.depth_factor)
        runs = results[arm.name]["runs"]
        entry = {"name": arm.name, "role": arm.role, **asdict(arm), **arm_costs(arm, config, scale)}
        entry["val_loss"] = _mean_spread([run["val_loss"] for run in runs])
        entry["primary_val_loss"] = _mean_spread([run["primary_val_loss"] for run in runs]) if arm.dual else None
        entry["wall_s"] = _mean_spread([run["wall_s"] for run in runs])
        entry["runs"] = runs
        summary.append(entry)
    add_paired_deltas(summary)
    return summary


def add_paired_deltas(arms: list[dict]) -> None:
    """
    Per arm, `val_loss_delta`: its val loss minus the first arm's (the single-flow k=2 baseline) for the same seed,
    mean / std over seeds. Same seed = same batches and same initial shared weights, so pairing removes the part of
    the seed-to-seed noise that the arms share (at tiny scale that part can be small).
    """
    baseline = {run["seed"]: run["val_loss"] for run in arms[0]["runs"]}
    for arm in arms:
        deltas = [run["val_loss"] - baseline[run["seed"]] for run in arm["runs"] if run["seed"] in baseline]
        arm["val_loss_delta"] = {"vs": arms[0]["name"], **_mean_spread(deltas)} if deltas else None


def format_table(arms: list[dict]) -> str:
    header = [
        "arm",
        "val loss (mean ± std)",
        "Δ vs first arm, paired",
        "primary-only val loss",
        "train MFLOP/tok",
        "train tokens",
        "prefill experts/tok",
        "decode experts/tok",
        "wall s/run",
    ]
    rows = []
    for arm in arms:
        primary = arm["primary_val_loss"]
        rows.append(
            [
                arm["name"],
                f"{arm['val_loss']['mean']:.4f} ± {arm['val_loss']['std']:.4f}",
                f"{arm['val_loss_delta']['mean']:+.4f} ± {arm['val_loss_delta']['std']:.4f}",
                f"{primary['mean']:.4f} ± {primary['std']:.4f}" if primary else "-",
                f"{arm['train_flops_per_token'] / 1e6:.2f}",
                f"{arm['train_tokens'] / 1e6:.2f}M",
                str(arm["prefill_experts_per_token"]),
                str(arm["decode_experts_per_token"]),
                f"{arm['wall_s']['mean']:.0f}",
            ]
        )
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    lines = [" | ".join(text.ljust(width) for text, width in zip(row, widths)) for row in [header] + rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def _smooth(values: list[float], window: int) -> list[float]:
    cumulative, out = [0.0], []
    for value in values:
        cumulative.append(cumulative[-1] + value)
    for i in range(len(values)):
        lo = max(0, i + 1 - window)
        out.append((cumulative[i + 1] - cumulative[lo]) / (i + 1 - lo))
    return out


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
        style = "--" if arm["aux_top_k"] else "-"
        ax.plot(x, smoothed, style, color=f"C{index}", label=f"{arm['name']} (val {arm['val_loss']['mean']:.3f})")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prefill_flops_per_token", "prefill cost (MFLOP / prompt token)"),
        ("decode_flops_per_token", "decode cost (MFLOP / generated token)"),
        ("train_flops_total", "training cost (total TFLOP)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), sharey=True)
    for ax, (key, label) in zip(axes, panels):
        divisor = 1e12 if key == "train_flops_total" else 1e6
        for index, arm in enumerate(report["arms"]):
            x = arm[key] / divisor
            marker = "s" if arm["aux_top_k"] else "o"
            ax.errorbar(
                x,
                arm["val_loss"]["mean"],
                yerr=arm["val_loss"]["std"],
                fmt=marker,
                color=f"C{index}",
                capsize=3,
                markersize=7,
                label=arm["name"],
            )
            ax.annotate(
                arm["name"],
                (x, arm["val_loss"]["mean"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=7,
                color=f"C{index}",
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/token; mean ± std over seeds)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Cost vs quality: lower-left is better (squares = dual-flow)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _command_line(args) -> str:
    parts = ["dualflow", "experiment"] + (["--quick"] if args.quick else [])
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps)):
        if value is not None:
            parts += [flag, str(value)]
    for flag, values in (("--data", args.data), ("--arms", args.arms)):
        if values:
            parts += [flag] + [shlex.quote(str(value)) for value in values]
    return " ".join(parts + ["--out", shlex.quote(str(args.out))])


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "experiment",
        help="train tiny MoE LMs from scratch: single-flow vs dual-flow arms, same tokens and seeds",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run of well under 3 minutes (too short to conclude anything)"
    )
    parser.add_argument("--data", nargs="+", help="text files (default: the Python standard library sources)")
    parser.add_argument("--seeds", type=int, help="seeds per arm (default 3; --quick: 2)")
    parser.add_argument("--steps", type=int, help="training steps per arm (the 2x-tokens arm runs twice as many)")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=[arm.name for arm in ARMS],
        metavar="ARM",
        help=f"subset of arms (default all: {', '.join(repr(arm.name) for arm in ARMS)})",
    )
    parser.add_argument("--out", default="runs/experiment", help="output folder (default runs/experiment)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: these matmuls are too small to gain from more)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    scale = QUICK_SCALE if args.quick else DEFAULT_SCALE
    if args.steps is not None:
        if args.steps < 1:
            raise DualFlowUserError(f"--steps must be >= 1, got {args.steps}")
        scale = replace(scale, steps=args.steps, warmup_steps=min(scale.warmup_steps, args.steps))
    num_seeds = args.seeds if args.seeds is not None else (2 if args.quick else 3)
    if num_seeds < 1:
        raise DualFlowUserError(f"--seeds must be >= 1, got {num_seeds}")
    if args.threads < 1:
        raise DualFlowUserError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    arms = [arm for arm in ARMS if not args.arms or arm.name in args.arms]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DualFlowUserError(f"--out {out} exists and is not a folder")

    train_tokens, val_blocks, data = load_corpus(args.data, scale)
    started = time.perf_counter()
    summary = run_arms(arms, scale, list(range(num_seeds)), train_tokens, val_blocks)
    report = {
        "schema": SCHEMA,
        "command": _command_line(args),
        "quick": args.quick,
        "scale": asdict(scale),
        "seeds": list(range(num_seeds)),
        "data": data,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "flops_formula": FLOPS_FORMULA,
        "wall_s_total": time.perf_counter() - started,
        "arms": summary,
    }
    report["table"] = format_table(summary)
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.json").write_text(json.dumps(report, indent=1))
    plot_loss_curves(report, out / "loss_curves.png")
    plot_frontier(report, out / "frontier.png")
    print(report["table"])
    print(
        f"val loss: mean next-token NLL of the prediction (aux flow for dual arms) over {data['val_tokens']} held-out "
        f"tokens; ± = std over {num_seeds} seed(s). Total {report['wall_s_total'] / 60:.1f} min."
    )
    print(f"wrote {out / 'experiment.json'}, {out / 'loss_curves.png'}, {out / 'frontier.png'}")
    if args.quick:
        print("--quick: far too few steps to conclude anything; run without --quick for the real comparison.")
    return 0
