"""Statistics over seeds: means with standard errors, differences paired by seed, shares of a reference gain."""

import math
import statistics


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


def ratio_and_error(numerators: dict[int, float], denominators: dict[int, float]) -> dict | None:
    """
    mean(numerator) / mean(denominator) over the seeds both have, with its standard error by the delta method (the
    per-seed pairs are correlated: same batches, same initial weights). None below 2 seeds.
    """
    seeds = sorted(set(numerators) & set(denominators))
    if len(seeds) < 2:
        return None
    a, b = [numerators[s] for s in seeds], [denominators[s] for s in seeds]
    mean_a, mean_b, n = statistics.fmean(a), statistics.fmean(b), len(seeds)
    ratio = mean_a / mean_b
    residuals = [x - ratio * y for x, y in zip(a, b)]  # var(a - r b) / (n mean_b^2) is the delta method's variance
    se = statistics.stdev(residuals) / math.sqrt(n) / abs(mean_b)
    return {"ratio": ratio, "se": se, "n": n}


def depth_gain_share(runs: list[dict], baseline_runs: list[dict], depth_runs: list[dict], target: float = 0.6) -> dict:
    """
    How much of the 2x-depth gain an arm closes, on the seeds all three share: the ratio of the mean paired gains (with
    its delta-method SE), and the paired test of the target, per seed (arm - baseline) - target * (depth - baseline):
    reached when that is below 0 by 2 standard errors, missed when above 0 by 2, undecided otherwise.
    """
    gains, depth_gains = paired_differences(runs, baseline_runs), paired_differences(depth_runs, baseline_runs)
    ratio = ratio_and_error(gains, depth_gains)
    if ratio is None:
        return None
    seeds = sorted(set(gains) & set(depth_gains))
    test = mean_and_error([gains[s] - target * depth_gains[s] for s in seeds])
    verdict = (
        "reached" if test["mean"] < -2 * test["se"] else "missed" if test["mean"] > 2 * test["se"] else "undecided"
    )
    return {
        "share": ratio["ratio"],
        "share_se": ratio["se"],
        "target": target,
        "arm_minus_target": test,
        "verdict": verdict,
    }


def format_error(stats: dict | None, digits: int = 4, sign: bool = True) -> str:
    """ "mean ± SE" of a `mean_and_error` dict ("-" for None, the mean alone for one value)."""
    if stats is None:
        return "-"
    mean = f"{stats['mean']:+.{digits}f}" if sign else f"{stats['mean']:.{digits}f}"
    return mean if stats["n"] < 2 else f"{mean} ± {stats['se']:.{digits}f}"
