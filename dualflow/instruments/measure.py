"""
`dualflow compare`'s measurements: every variant of one checkpoint, side by side in one process.

Timings are interleaved (A B C D, then B C D A, ...: the order rotates each repeat) and reduced to the median, so
machine noise hits every variant alike. Each repeat also gives a ratio to primary-only measured moments apart; their
range shows how far the machine let the timings drift.
"""

import statistics
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .data import eval_blocks
from .probes import peak_memory_bytes, peak_memory_method, rotated, seconds
from .tables import text_table
from .variants import BASELINE, Variant, build_variants


SCHEMA = "dualflow-compare/2"
NOISY_SPREAD = 1.5  # largest / smallest per-repeat ratio of one cell above which the timings are too noisy to read


@dataclass(frozen=True)
class CompareSettings:
    prompt_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    decode_tokens: int = 32
    decode_prompt_length: int = 64
    repeats: int = 5
    eval_block_size: int = 128
    eval_blocks: int = 32
    eval_batch_size: int = 8


def token_windows(tokens: torch.Tensor, batch_size: int, length: int, offset: int = 0) -> torch.Tensor:
    """(batch_size, length) consecutive windows of `tokens`, wrapping around when the data is short."""
    index = offset + torch.arange(batch_size * length).view(batch_size, length)
    return tokens[index % len(tokens)]


@torch.no_grad()
def kv_cache_bytes(variant: Variant, input_ids: torch.Tensor) -> int:
    """Bytes held by the cache after `variant` prefilled `input_ids`."""
    cache = variant.new_cache()
    variant.step(input_ids, cache)
    return cache.nbytes()


def _ratio_range(samples: list[float], baseline: list[float], inverse: bool = False) -> list[float]:
    """[min, max] over repeats of sample / baseline sample of the same repeat (baseline / sample when `inverse`)."""
    ratios = [(b / s if inverse else s / b) for s, b in zip(samples, baseline)]
    return [min(ratios), max(ratios)]


@torch.no_grad()
def measure(variants: list[Variant], tokens: torch.Tensor, settings: CompareSettings, show_progress=True) -> dict:
    """
    Every metric for every variant. `tokens`: 1-D token ids of the data (prompts, decode streams and validation blocks
    are cut from it). Returns {variant: {prefill_ms: {L: ms}, decode_tokens_per_s: {B: tok/s}, prefill_ratio_range:
    {L: [min, max]}, decode_ratio_range: {B: [min, max]}, kv_cache_bytes, peak_memory_bytes,
    peak_memory_increase_bytes, val_loss}}.
    """
    device = variants[0].runner.device
    tokens = tokens.to(device)
    longest = max(settings.prompt_lengths)
    prompts = {length: token_windows(tokens, 1, length) for length in settings.prompt_lengths}
    decode_inputs = {
        batch: token_windows(tokens, batch, settings.decode_prompt_length + settings.decode_tokens, offset=longest)
        for batch in settings.batch_sizes
    }

    def prefill(variant, length):
        return lambda: variant.step(prompts[length], variant.new_cache())

    def decode(variant, batch):
        def run():
            cache = variant.new_cache()
            variant.step(decode_inputs[batch][:, : settings.decode_prompt_length], cache)
            stream = decode_inputs[batch][:, settings.decode_prompt_length :]
            # Teacher-forced from the data, so every variant decodes the very same tokens.

            def steps():
                for i in range(stream.shape[1]):
                    variant.step(stream[:, i : i + 1], cache)

            return seconds(steps, device=device)

        return run

    raw = {
        variant.name: {"prefill": {L: [] for L in prompts}, "decode": {B: [] for B in decode_inputs}, "peak": []}
        for variant in variants
    }
    for variant in variants:  # warm-up: first calls pay one-off allocation and dispatch costs
        prefill(variant, min(prompts))()
        decode(variant, min(decode_inputs))()
    jobs = settings.repeats * len(variants) * (len(prompts) + len(decode_inputs) + 1)
    with tqdm(total=jobs, desc="timing", disable=not show_progress) as bar:
        for repeat in range(settings.repeats):
            order = rotated(variants, repeat)
            for length in prompts:
                for variant in order:
                    raw[variant.name]["prefill"][length].append(seconds(prefill(variant, length), device=device))
                    bar.update()
            for batch in decode_inputs:
                for variant in order:
                    raw[variant.name]["decode"][batch].append(decode(variant, batch)())
                    bar.update()
            for variant in order:
                raw[variant.name]["peak"].append(peak_memory_bytes(prefill(variant, longest), device))
                bar.update()

    blocks = eval_blocks(tokens.cpu(), settings.eval_block_size, settings.eval_blocks)
    base = raw[BASELINE]
    metrics = {}
    for variant in tqdm(variants, desc="val loss", disable=not show_progress):
        timings = raw[variant.name]
        metrics[variant.name] = {
            "prefill_ms": {str(L): 1000 * statistics.median(t) for L, t in timings["prefill"].items()},
            "decode_tokens_per_s": {
                str(B): B * settings.decode_tokens / statistics.median(t) for B, t in timings["decode"].items()
            },
            "prefill_ratio_range": {str(L): _ratio_range(t, base["prefill"][L]) for L, t in timings["prefill"].items()},
            "decode_ratio_range": {
                str(B): _ratio_range(t, base["decode"][B], inverse=True) for B, t in timings["decode"].items()
            },
            "kv_cache_bytes": kv_cache_bytes(variant, prompts[longest]),
            "peak_memory_bytes": int(statistics.median(peak for peak, _ in timings["peak"])),
            "peak_memory_increase_bytes": int(statistics.median(increase for _, increase in timings["peak"])),
            "val_loss": variant.nll(blocks, settings.eval_batch_size),
        }
    return metrics


RATIO_METRICS = ("prefill_ms", "decode_tokens_per_s", "kv_cache_bytes", "peak_memory_bytes")


def ratios_vs_baseline(metrics: dict) -> dict:
    """Each variant's cost metrics divided by primary-only's (same nesting)."""

    def divide(value, base):
        if isinstance(value, dict):
            return {key: divide(value[key], base[key]) for key in value}
        return value / base

    return {
        name: {key: divide(values[key], metrics[BASELINE][key]) for key in RATIO_METRICS}
        for name, values in metrics.items()
    }


def noisy_cells(metrics: dict) -> list[str]:
    """Timing cells whose per-repeat ratios to primary-only spread by more than NOISY_SPREAD (largest / smallest)."""
    noisy = []
    for name, values in metrics.items():
        for key, label in (("prefill_ratio_range", "prefill {}"), ("decode_ratio_range", "decode batch {}")):
            for setting, (low, high) in values[key].items():
                if name != BASELINE and high > NOISY_SPREAD * low:
                    noisy.append(f"{name}, {label.format(setting)}: {low:.2f}x to {high:.2f}x")
    return noisy


def noise_warning(noisy: list[str]) -> str:
    return (
        f"too noisy to read: the per-repeat ratios of {len(noisy)} timing(s) spread by more than {NOISY_SPREAD}x "
        f"(e.g. {noisy[0]}); rerun on an idle machine, with --threads 1 or more repeats"
    )


def format_table(metrics: dict, ratios: dict, memory_rows: bool = True) -> str:
    """
    Metrics as rows, variants as columns. Timing cells: median (ratio to primary-only, range of the per-repeat
    ratios); other costs: value (ratio); the memory increase and the loss: value (difference to primary-only).
    `memory_rows`: the peak memory rows (left out on CPU, where the process's peak RSS hardly moves with a forward).
    """
    names = list(metrics)
    base = metrics[BASELINE]

    def timing(name, key, range_key, setting, fmt):
        value = fmt(metrics[name][key][setting])
        if name == BASELINE:
            return value
        low, high = metrics[name][range_key][setting]
        return f"{value} ({ratios[name][key][setting]:.2f}x, {low:.2f}-{high:.2f})"

    def ratio(name, key, fmt):
        value = fmt(metrics[name][key])
        return value if name == BASELINE else f"{value} ({ratios[name][key]:.2f}x)"

    def difference(name, key, digits, scale=1.0):
        value = metrics[name][key] / scale
        text = f"{value:.{digits}f}"
        return text if name == BASELINE else f"{text} ({value - base[key] / scale:+.{digits}f})"

    rows = [
        [f"prefill ms, prompt {L}"]
        + [timing(n, "prefill_ms", "prefill_ratio_range", L, "{:.2f}".format) for n in names]
        for L in base["prefill_ms"]
    ]
    rows += [
        [f"decode tok/s, batch {B}"]
        + [timing(n, "decode_tokens_per_s", "decode_ratio_range", B, "{:.1f}".format) for n in names]
        for B in base["decode_tokens_per_s"]
    ]
    rows.append(["KV cache KiB"] + [ratio(n, "kv_cache_bytes", lambda v: f"{v / 1024:.1f}") for n in names])
    if memory_rows:
        rows.append(["peak memory MiB"] + [ratio(n, "peak_memory_bytes", lambda v: f"{v / 2**20:.1f}") for n in names])
        rows.append(["increase MiB"] + [difference(n, "peak_memory_increase_bytes", 1, 2**20) for n in names])
    rows.append(["val loss (nats/token)"] + [difference(n, "val_loss", 4) for n in names])
    return text_table(["metric", *names], rows)


def decode_ms_per_aux_round(metrics: dict, num_rounds: int) -> dict[str, float]:
    """Per decode batch: what each aux round after the first adds to the time per decode step (ms), from the dual-flow
    variants with `num_rounds` rounds and with one (the decode time of a round is what batch-1 serving pays)."""

    def step_ms(name, batch):
        return 1000 * int(batch) / metrics[name]["decode_tokens_per_s"][batch]

    return {
        batch: (step_ms("dual-flow", batch) - step_ms("dual-flow r1", batch)) / (num_rounds - 1)
        for batch in metrics["dual-flow"]["decode_tokens_per_s"]
    }


def compare_report(
    model, model_name: str, data_names: list[str], tokens, settings: CompareSettings, show_progress=True
) -> dict:
    """Measure and assemble the JSON-ready report (schema `dualflow-compare/2`)."""
    config = model.config
    variants = build_variants(model)
    metrics = measure(variants, tokens, settings, show_progress)
    ratios = ratios_vs_baseline(metrics)
    return {
        "schema": SCHEMA,
        "model": model_name,
        "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        "config": {
            key: getattr(config, key)
            for key in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "num_experts",
                "num_experts_per_tok",
                "aux_num_experts_per_tok",
                "aux_num_rounds",
            )
        },
        "settings": {
            "prompt_lengths": list(settings.prompt_lengths),
            "batch_sizes": list(settings.batch_sizes),
            "decode_tokens": settings.decode_tokens,
            "decode_prompt_length": settings.decode_prompt_length,
            "repeats": settings.repeats,
            "prefill_batch_size": 1,
            "eval_block_size": settings.eval_block_size,
            "eval_tokens": min(settings.eval_blocks, len(tokens) // settings.eval_block_size)
            * settings.eval_block_size,
            "data": data_names,
        },
        "peak_memory_method": peak_memory_method(model.device) + "; prefill of the longest prompt, batch 1",
        "variants": [variant.name for variant in variants],
        "metrics": metrics,
        "ratios_vs_primary_only": ratios,
        "decode_ms_per_aux_round": (
            decode_ms_per_aux_round(metrics, config.aux_num_rounds) if config.aux_num_rounds > 1 else None
        ),
        "noisy_timings": noisy_cells(metrics),
        # On CPU the peak RSS of the whole process shows the same figure in every column: in the JSON only.
        "table": format_table(metrics, ratios, memory_rows=model.device.type == "cuda"),
    }
