"""PNG plots of the instruments' reports: `dualflow compare` and `dualflow experiment` (matplotlib: the `instruments`
extra)."""

import statistics

from ..errors import DualFlowUserError


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise DualFlowUserError(
            "plots need matplotlib: pip install 'dualflow-transformers[instruments]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_compare(report: dict, path) -> None:
    """Write `compare_figure(report)` as a PNG."""
    fig = compare_figure(report)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def compare_figure(report: dict):
    """Prefill latency by prompt length, decode throughput by batch size and validation loss, per variant."""
    plt = pyplot()
    metrics = report["metrics"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, values in metrics.items():
        lengths = [int(L) for L in values["prefill_ms"]]
        axes[0].plot(lengths, list(values["prefill_ms"].values()), marker="o", label=name)
        batches = [int(B) for B in values["decode_tokens_per_s"]]
        axes[1].plot(batches, list(values["decode_tokens_per_s"].values()), marker="o", label=name)
    axes[0].set(xscale="log", xlabel="prompt length (tokens)", ylabel="prefill latency (ms, median)")
    axes[0].set_xticks(lengths, [str(L) for L in lengths], minor=False)
    axes[0].minorticks_off()
    axes[0].set_title("Prefill (batch 1)")
    axes[1].set(xscale="log", xlabel="batch size", ylabel="decode tokens/s (median)")
    axes[1].set_xticks(batches, [str(B) for B in batches])
    axes[1].minorticks_off()
    axes[1].set_title("Decode throughput")
    names = list(metrics)
    losses = [metrics[name]["val_loss"] for name in names]
    axes[2].bar(range(len(names)), losses, color=[f"C{i}" for i in range(len(names))])
    axes[2].set_xticks(range(len(names)), names, rotation=20, ha="right")
    axes[2].set_ylim(min(losses) - 0.1 * (max(losses) - min(losses) + 0.05), max(losses) + 0.05)
    axes[2].set(ylabel="validation loss (nats/token)")
    axes[2].set_title("Validation loss")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"dualflow compare: {report['model']} ({report['device']}, {report['dtype']})", fontsize=10)
    fig.tight_layout()
    return fig


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
    return pyplot().get_cmap("tab20")(index % 20)


def main_scale_arms(report: dict) -> list[dict]:
    """The arms at the report's own scale (the size study's arms have curves and baselines of their own)."""
    return [arm for arm in report["arms"] if "hidden_size" not in arm["training"]]


def plot_loss_curves(report: dict, path) -> None:
    """Mean training curve of each arm at the report's scale (dashed: dual-flow)."""
    plt = pyplot()
    scale = report["scale"]
    tokens_per_step = scale["batch_size"] * scale["block_size"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lowest = []
    for index, arm in enumerate(main_scale_arms(report)):
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
    plt = pyplot()
    panels = [
        ("prefill_flops_per_token", "prefill cost (MFLOP / prompt token)"),
        ("decode_flops_per_token", "decode cost (MFLOP / generated token)"),
        ("train_flops_total", "training cost (total TFLOP)"),
    ]
    arms = main_scale_arms(report)
    legend_rows = -(-len(arms) // 4)  # the legend below the panels: 4 arms per row
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2 + 0.2 * legend_rows), sharey=True)
    label_points = len(arms) <= 10  # beyond that the names overlap: the legend alone says which is which
    for ax, (key, label) in zip(axes, panels):
        divisor = 1e12 if key == "train_flops_total" else 1e6
        for index, arm in enumerate(arms):
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


def plot_depth_share_vs_size(rows: list[dict], path) -> None:
    """The share of the 2x-depth gain (± SE) each dual design closes, against the hidden size (the size study)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sizes = [row["hidden_size"] for row in rows]
    for offset, design in ((-1.0, "paper design"), (1.0, "best design")):
        shares = [row[design]["depth_gain_share"] for row in rows]
        ax.errorbar(
            [size + offset for size in sizes],
            [100 * share["share"] for share in shares],
            yerr=[100 * share["share_se"] for share in shares],
            fmt="o-",
            capsize=4,
            label=design,
        )
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.set(xlabel="hidden size", ylabel="share of the 2x-depth gain (%, ± SE)")
    ax.set_title("Dual-Flow's share of the 2x-depth gain by model size (paired seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_token_scaling(report: dict, path) -> None:
    """
    The token study: each arm's validation loss against its training tokens (log x, mean ± SE over seeds), and each
    arm's training cost per token beside it (CPU seconds per 1k tokens, one thread a run).
    """
    from .arms import TOKEN_STUDY, budget_name

    plt = pyplot()
    by_name = {arm["name"]: arm for arm in report["arms"]}
    rows = report["token_study"]
    fig, (losses, costs) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for index, (role, name) in enumerate(TOKEN_STUDY.items()):
        arms = [by_name[budget_name(name, row["token_factor"])] for row in rows]
        tokens = [row["train_tokens"] for row in rows]
        mean = [arm["val_loss"]["mean"] for arm in arms]
        error = [arm["val_loss"]["se"] or 0.0 for arm in arms]
        losses.errorbar(
            tokens, mean, yerr=error, marker="o", capsize=3, color=arm_color(index), label=f"{role}: {name}"
        )
        costs.bar(index, 1000 / arms[0]["tokens_per_cpu_s"], color=arm_color(index))
    losses.set(xscale="log", xlabel="training tokens", ylabel="validation loss (nats/token)")
    losses.set_xticks([row["train_tokens"] for row in rows], [f"{row['token_factor']}x" for row in rows])
    losses.minorticks_off()
    losses.set_title("Loss vs training tokens (mean ± SE over seeds)")
    losses.legend(fontsize=7)
    costs.set_xticks(range(len(TOKEN_STUDY)), list(TOKEN_STUDY), rotation=20, ha="right")
    costs.set(ylabel="training CPU-s per 1k tokens")
    costs.set_title("Training cost per token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
