"""PNG plots of `dualflow compare` reports (matplotlib: the `instruments` extra)."""

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
    fig.savefig(path, dpi=110)
    plt.close(fig)
