"""`dualflow compare`: what the aux flow costs and buys on one Dual-Flow checkpoint, measured side by side.

Variants, all run in the same process on the same weights, interleaved (A B C D A B C D ...) and summarised by the
median so that machine noise hits every variant alike:
- primary-only: aux flow off, the base model;
- dual-flow: the grouped execution (aux flow on);
- two-pass reference: `dualflow.reference.two_pass_forward`, the primary step with cache then a separate aux pass;
- single top-k=k_a (MoE only): aux flow off, every token routed to k_a experts ("scale the whole model").
"""

import gc
import json
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling_dualflow import DualFlowCache, DualFlowForCausalLM

from ..checkpoint import load_dualflow_config
from ..errors import DualFlowUserError
from .data import (
    BYTE_VOCAB_SIZE,
    check_data_files,
    eval_blocks,
    read_byte_tokens,
    split_files,
    stdlib_source_files,
)
from .reference import two_pass_forward
from .tiny_lm import TinyScale, mean_token_nll, next_token_nll, tiny_moe_config, train_language_model


SCHEMA = "dualflow-compare/1"
BASELINE = "primary-only"
BUILTIN_NAME = "built-in tiny MoE (byte-level, trained in-process)"
DEFAULT_DATA_FILES = 4  # held-out stdlib files scored when no --data is given


@contextmanager
def primary_top_k(model, top_k: int | None):
    """Temporarily route every primary token to `top_k` experts (None: leave the model as it is)."""
    blocks = [module for module in model.modules() if hasattr(module, "top_k") and hasattr(module, "experts")]
    saved = [block.top_k for block in blocks]
    try:
        if top_k is not None:
            for block in blocks:
                block.top_k = top_k
        yield
    finally:
        for block, value in zip(blocks, saved):
            block.top_k = value


@dataclass(frozen=True)
class Variant:
    """One way of running the checkpoint: aux flow on/off, a primary top-k override, or the two-pass reference."""

    name: str
    use_aux_flow: bool
    top_k: int | None = None
    two_pass: bool = False

    def step(self, model, input_ids: torch.Tensor, cache: DualFlowCache) -> torch.Tensor:
        """Feed `input_ids` after the tokens already in `cache`; return the next-token logits (batch, vocab)."""
        with primary_top_k(model, self.top_k):
            if self.two_pass:
                last = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
                return two_pass_forward(model, input_ids, cache, aux_positions=last)[1][:, -1]
            outputs = model(
                input_ids, past_key_values=cache, use_cache=True, use_aux_flow=self.use_aux_flow, logits_to_keep=1
            )
            return outputs.logits[:, -1]

    @torch.no_grad()
    def nll(self, model, blocks: torch.Tensor, batch_size: int) -> float:
        """Mean next-token NLL of this variant's prediction over `blocks` (num_blocks, T)."""
        with primary_top_k(model, self.top_k):
            if not self.two_pass:
                return mean_token_nll(model, blocks, batch_size, use_aux_flow=self.use_aux_flow)
            # Same-length blocks: the mean of per-block means is the token mean.
            losses = [
                next_token_nll(two_pass_forward(model, block[None], DualFlowCache(config=model.config))[1], block[None])
                for block in blocks.to(model.device)
            ]
            return float(torch.stack(losses).mean())


def build_variants(config) -> list[Variant]:
    variants = [
        Variant(BASELINE, use_aux_flow=False),
        Variant("dual-flow", use_aux_flow=True),
        Variant("two-pass reference", use_aux_flow=True, two_pass=True),
    ]
    if config.num_experts:
        k_a = config.aux_num_experts_per_tok
        variants.append(Variant(f"single top-k={k_a}", use_aux_flow=False, top_k=k_a))
    return variants


@torch.no_grad()
def kv_cache_bytes(model, variant: Variant, input_ids: torch.Tensor) -> int:
    """Bytes held by the cache after `variant` prefilled `input_ids`."""
    cache = DualFlowCache(config=model.config)
    variant.step(model, input_ids, cache)
    return cache.nbytes()


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated() (all tensors, weights included)"
    if _status_kib("VmHWM") is not None and os.access("/proc/self/clear_refs", os.W_OK):
        return "process peak RSS (Linux VmHWM, reset via /proc/self/clear_refs before the call)"
    return "process lifetime peak RSS (getrusage ru_maxrss; cannot be reset, so an older peak can hide this one)"


def peak_memory_bytes(fn, device: torch.device) -> tuple[int, int]:
    """(peak memory during `fn()`, that peak minus the memory in use before it); see `peak_memory_method`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return peak, peak - before
    if "VmHWM" in peak_memory_method(device):
        Path("/proc/self/clear_refs").write_text("5")  # 5 = reset the peak RSS to the current RSS
        before = _status_kib("VmRSS")
        fn()
        peak = _status_kib("VmHWM")
        return peak * 1024, (peak - before) * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * scale, (peak - before) * scale


def _seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def token_windows(tokens: torch.Tensor, batch_size: int, length: int, offset: int = 0) -> torch.Tensor:
    """(batch_size, length) consecutive windows of `tokens`, wrapping around when the data is short."""
    index = offset + torch.arange(batch_size * length).view(batch_size, length)
    return tokens[index % len(tokens)]


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


@torch.no_grad()
def measure(
    model, variants: list[Variant], tokens: torch.Tensor, settings: CompareSettings, show_progress=True
) -> dict:
    """
    Every metric for every variant. Timings are interleaved across variants and repeats, then reduced to the median.
    `tokens`: 1-D token ids of the data (prompts, decode streams and validation blocks are cut from it).
    Returns {variant: {prefill_ms: {L: ms}, decode_tokens_per_s: {B: tok/s}, kv_cache_bytes, peak_memory_bytes,
    peak_memory_increase_bytes, val_loss}}.
    """
    device = model.device
    tokens = tokens.to(device)
    longest = max(settings.prompt_lengths)
    prompts = {length: token_windows(tokens, 1, length) for length in settings.prompt_lengths}
    decode_inputs = {
        batch: token_windows(tokens, batch, settings.decode_prompt_length + settings.decode_tokens, offset=longest)
        for batch in settings.batch_sizes
    }

    def prefill(variant, length):
        return lambda: variant.step(model, prompts[length], DualFlowCache(config=model.config))

    def decode(variant, batch):
        def run():
            cache = DualFlowCache(config=model.config)
            variant.step(model, decode_inputs[batch][:, : settings.decode_prompt_length], cache)
            stream = decode_inputs[batch][:, settings.decode_prompt_length :]
            # Teacher-forced from the data, so every variant decodes the very same tokens.

            def steps():
                for i in range(stream.shape[1]):
                    variant.step(model, stream[:, i : i + 1], cache)

            return _seconds(steps, device)

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
            # Rotate the order each repeat so no variant always runs right after the same one.
            order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
            for length in prompts:
                for variant in order:
                    raw[variant.name]["prefill"][length].append(_seconds(prefill(variant, length), device))
                    bar.update()
            for batch in decode_inputs:
                for variant in order:
                    raw[variant.name]["decode"][batch].append(decode(variant, batch)())
                    bar.update()
            for variant in order:
                raw[variant.name]["peak"].append(peak_memory_bytes(prefill(variant, longest), device))
                bar.update()

    blocks = eval_blocks(tokens.cpu(), settings.eval_block_size, settings.eval_blocks)
    metrics = {}
    for variant in tqdm(variants, desc="val loss", disable=not show_progress):
        timings = raw[variant.name]
        metrics[variant.name] = {
            "prefill_ms": {str(L): 1000 * statistics.median(t) for L, t in timings["prefill"].items()},
            "decode_tokens_per_s": {
                str(B): B * settings.decode_tokens / statistics.median(t) for B, t in timings["decode"].items()
            },
            "kv_cache_bytes": kv_cache_bytes(model, variant, prompts[longest]),
            "peak_memory_bytes": int(statistics.median(peak for peak, _ in timings["peak"])),
            "peak_memory_increase_bytes": int(statistics.median(increase for _, increase in timings["peak"])),
            "val_loss": variant.nll(model, blocks, settings.eval_batch_size),
        }
    return metrics


def ratios_vs_baseline(metrics: dict) -> dict:
    """Each variant's metrics divided by primary-only's (same nesting)."""

    def divide(value, base):
        if isinstance(value, dict):
            return {key: divide(value[key], base[key]) for key in value}
        return value / base if base else None

    return {name: divide(values, metrics[BASELINE]) for name, values in metrics.items()}


def _table_rows(metrics: dict, ratios: dict) -> list[tuple[str, list[str]]]:
    names = list(metrics)
    first = metrics[names[0]]

    def cell(name, path, fmt):
        value, ratio = metrics[name], ratios[name]
        for key in path:
            value, ratio = value[key], ratio[key]
        if name == BASELINE:
            return fmt(value)
        return f"{fmt(value)} ({ratio:.2f}x)" if ratio is not None else f"{fmt(value)} (n/a)"

    rows = []
    for length in first["prefill_ms"]:
        rows.append(
            (f"prefill ms, prompt {length}", [cell(n, ("prefill_ms", length), lambda v: f"{v:.2f}") for n in names])
        )
    for batch in first["decode_tokens_per_s"]:
        rows.append(
            (
                f"decode tok/s, batch {batch}",
                [cell(n, ("decode_tokens_per_s", batch), lambda v: f"{v:.1f}") for n in names],
            )
        )
    rows.append(("KV cache KiB", [cell(n, ("kv_cache_bytes",), lambda v: f"{v / 1024:.1f}") for n in names]))
    rows.append(("peak memory MiB", [cell(n, ("peak_memory_bytes",), lambda v: f"{v / 2**20:.1f}") for n in names]))
    rows.append(
        ("  increase MiB", [cell(n, ("peak_memory_increase_bytes",), lambda v: f"{v / 2**20:.1f}") for n in names])
    )
    base_loss = metrics[BASELINE]["val_loss"]
    rows.append(
        (
            "val loss (nats/token)",
            [
                f"{metrics[n]['val_loss']:.4f}"
                + ("" if n == BASELINE else f" ({metrics[n]['val_loss'] - base_loss:+.4f})")
                for n in names
            ],
        )
    )
    return rows


def format_table(metrics: dict, ratios: dict) -> str:
    """Metrics as rows, variants as columns; cost cells carry (ratio vs primary-only), the loss (difference)."""
    names = list(metrics)
    rows = _table_rows(metrics, ratios)
    header = ["metric"] + names
    widths = [max(len(header[0]), *(len(label) for label, _ in rows))]
    widths += [max(len(name), *(len(cells[i]) for _, cells in rows)) for i, name in enumerate(names)]
    lines = ["  ".join(text.ljust(width) for text, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    for label, cells in rows:
        lines.append("  ".join(text.ljust(width) for text, width in zip([label] + cells, widths)))
    return "\n".join(lines)


def compare_report(
    model, model_name: str, data_names: list[str], tokens, settings: CompareSettings, show_progress=True
) -> dict:
    """Measure and assemble the JSON-ready report (schema `dualflow-compare/1`)."""
    config = model.config
    variants = build_variants(config)
    metrics = measure(model, variants, tokens, settings, show_progress)
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
        "table": format_table(metrics, ratios),
    }


def plot_report(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def builtin_model(steps: int, show_progress: bool = True) -> DualFlowForCausalLM:
    """Tiny byte-level MoE (8 experts, k_p=2, k_a=4) briefly trained on stdlib code, so its losses mean something."""
    scale = TinyScale()
    train_files, _ = split_files(stdlib_source_files())
    train_tokens = read_byte_tokens(train_files, max_tokens=4_000_000)
    # One thread: these matmuls are too small to gain from a second one, and it is several times faster on a busy CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = train_language_model(
            tiny_moe_config(scale, top_k=2, aux_top_k=4),
            train_tokens,
            scale,
            seed=0,
            steps=steps,
            desc="training the built-in model",
            show_progress=show_progress,
        )
    finally:
        torch.set_num_threads(threads)
    return model


def load_checkpoint(path: str) -> tuple[DualFlowForCausalLM, object | None]:
    """(model, tokenizer or None for byte-level) from a Dual-Flow folder."""
    from transformers import AutoTokenizer

    folder = Path(path)
    config = load_dualflow_config(folder)
    model = DualFlowForCausalLM.from_pretrained(folder, config=config).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        if config.vocab_size < BYTE_VOCAB_SIZE:
            raise DualFlowUserError(
                f"{path} has no tokenizer and a vocabulary of {config.vocab_size} < 256: cannot use byte-level tokens"
            ) from None
        tokenizer = None
    return model, tokenizer


def data_tokens(data_paths, tokenizer) -> tuple[torch.Tensor, list[str]]:
    """1-D token ids of the data (byte-level when `tokenizer` is None) and the file names used."""
    if data_paths:
        files = check_data_files(data_paths)
    else:
        files = split_files(stdlib_source_files())[1][:DEFAULT_DATA_FILES]
    if tokenizer is None:
        tokens = read_byte_tokens(files).long()
    else:
        text = "\n\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    return tokens, [str(path) for path in files]


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise DualFlowUserError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DualFlowUserError(f"expected positive integers, got {text!r}")
    return values


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="measure prefill, decode, KV cache, memory and loss: primary-only vs dual-flow vs alternatives",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("model", nargs="?", help="Dual-Flow model folder (default: a built-in tiny MoE)")
    parser.add_argument("--data", nargs="+", help="text files to score and cut prompts from (default: stdlib sources)")
    parser.add_argument("--prompt-lengths", help="prefill prompt lengths (default 128,512,2048; built-in: 64,256,1024)")
    parser.add_argument("--batch", default="1,8", help="decode batch sizes (default 1,8)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per run (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per timing (median; default 5)")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="validation tokens scored (default 2048)")
    parser.add_argument("--train-steps", type=int, default=150, help="training steps of the built-in model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--plot", help="write a PNG of the measurements here")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.decode_tokens < 1 or args.repeats < 1 or args.eval_tokens < 2:
        raise DualFlowUserError("--decode-tokens and --repeats must be >= 1, --eval-tokens >= 2")
    if args.train_steps < 1:  # train_language_model reads 0 as "the default 400 steps"
        raise DualFlowUserError(f"--train-steps must be >= 1, got {args.train_steps}")
    batch_sizes = _int_list(args.batch)
    try:  # before loading or training anything
        device = torch.device(args.device)
    except RuntimeError:
        raise DualFlowUserError(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DualFlowUserError("--device cuda: torch sees no CUDA GPU here")
    if args.data:
        check_data_files(args.data)  # fail on a bad path before loading or training anything
    if args.threads is not None:
        if args.threads < 1:
            raise DualFlowUserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.model:
        model, tokenizer = load_checkpoint(args.model)
        prompt_lengths = _int_list(args.prompt_lengths or "128,512,2048")
        name = args.model
    else:
        model, tokenizer = builtin_model(args.train_steps), None
        prompt_lengths = _int_list(args.prompt_lengths or "64,256,1024")
        name = BUILTIN_NAME
    limit = model.config.max_position_embeddings
    if max(prompt_lengths) > limit:
        raise DualFlowUserError(f"prompt length {max(prompt_lengths)} exceeds max_position_embeddings={limit}")
    model.to(device)
    tokens, data_names = data_tokens(args.data, tokenizer)
    block_size = min(128 if not args.model else 512, limit, args.eval_tokens)
    settings = CompareSettings(
        prompt_lengths=prompt_lengths,
        batch_sizes=batch_sizes,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        eval_block_size=block_size,
        eval_blocks=max(1, args.eval_tokens // block_size),
    )
    report = compare_report(model, name, data_names, tokens, settings)
    print(f"\nmodel: {name}  ({report['device']}, {report['dtype']}, {report['torch_threads']} threads)")
    print(report["table"])
    print(f"prefill: batch 1. decode: {settings.decode_tokens} tokens after {settings.decode_prompt_length} prompt")
    print(f"peak memory: {report['peak_memory_method']}")
    print(f"val loss: mean next-token NLL over {report['settings']['eval_tokens']} tokens of {len(data_names)} file(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
