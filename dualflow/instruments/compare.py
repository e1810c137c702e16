"""
`dualflow compare`: what the aux flow costs and buys on one Dual-Flow checkpoint, measured side by side.

Variants (all run in one process on the same weights, see `variants.py`): primary-only (aux flow off), dual-flow (the
grouped execution), two-pass (the same result as two batched passes over the layers) and, for MoE models, single
top-k=k_a (aux flow off, every token routed to k_a experts). Timings are interleaved and reduced to medians.

This module is the command line only: it checks the arguments before importing torch, so mistakes fail at once.
"""

import argparse
import json
from pathlib import Path

from ..checkpoint import check_model_path
from ..errors import DualFlowUserError


BUILTIN_NAME = "built-in tiny MoE (byte-level, trained in-process)"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise DualFlowUserError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DualFlowUserError(f"expected positive integers, got {text!r}")
    return values


def build_parser(prog: str = "dualflow compare") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="Dual-Flow model folder or Hub id (default: a built-in tiny MoE)")
    parser.add_argument("--data", nargs="+", help="text files to score and cut prompts from (default: stdlib sources)")
    parser.add_argument("--prompt-lengths", help="prefill prompt lengths (default 128,512,2048; built-in: 64,256,1024)")
    parser.add_argument("--batch", default="1,8", help="decode batch sizes (default 1,8)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per run (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per timing (median; default 5)")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="validation tokens scored (default 2048)")
    parser.add_argument("--train-steps", type=int, default=150, help="training steps of the built-in model")
    parser.add_argument(
        "--aux-rounds",
        type=int,
        help="aux rounds of the built-in model (default 1); a checkpoint has its own (dualflow convert --aux-rounds)",
    )
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--plot", help="write a PNG of the measurements here (needs matplotlib)")
    return parser


def check_output_file(flag: str, path: Path) -> None:
    """A one-line error now, not after the measurement, for an output file that cannot be written."""
    if path.is_dir():
        raise DualFlowUserError(f"{flag} {path} is a folder: give a file name")
    existed = path.exists()
    try:
        with open(path, "ab"):  # creates nothing but an empty file, removed again below
            pass
    except OSError as error:
        raise DualFlowUserError(f"{flag} {path} cannot be written: {error.strerror}") from None
    if not existed:
        path.unlink()


def run(args) -> int:
    if args.decode_tokens < 1 or args.repeats < 1 or args.eval_tokens < 2:
        raise DualFlowUserError("--decode-tokens and --repeats must be >= 1, --eval-tokens >= 2")
    if args.train_steps < 1:
        raise DualFlowUserError(f"--train-steps must be >= 1, got {args.train_steps}")
    if args.threads is not None and args.threads < 1:
        raise DualFlowUserError(f"--threads must be >= 1, got {args.threads}")
    if args.aux_rounds is not None and (args.model or args.aux_rounds < 1):
        raise DualFlowUserError(
            "--aux-rounds sets the built-in model's rounds (>= 1); a checkpoint's come from its config"
        )
    batch_sizes = _int_list(args.batch)
    prompt_lengths = _int_list(args.prompt_lengths or ("128,512,2048" if args.model else "64,256,1024"))
    if args.model:
        check_model_path(args.model)
    if args.plot:
        from .plots import pyplot

        pyplot()  # fails now, not after the measurement, when matplotlib is missing
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(flag, Path(path))

    import torch

    from .data import check_data_files
    from .inputs import builtin_model, data_tokens, load_checkpoint
    from .measure import CompareSettings, compare_report, noise_warning

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise DualFlowUserError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DualFlowUserError("--device cuda: torch sees no CUDA GPU here")
    if args.data:
        check_data_files(args.data)  # before loading or training anything
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model:
        model, tokenizer = load_checkpoint(args.model)
        name = args.model
    else:
        model, tokenizer = builtin_model(args.train_steps, aux_rounds=args.aux_rounds or 1), None
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
    print(
        f"timings: medians of {settings.repeats} interleaved repeats; (ratio to primary-only, range of the per-repeat "
        f"ratios). prefill: batch 1. decode: {settings.decode_tokens} tokens after {settings.decode_prompt_length}"
    )
    if report["decode_ms_per_aux_round"]:
        per_round = ", ".join(f"batch {B}: {ms:.2f} ms" for B, ms in report["decode_ms_per_aux_round"].items())
        print(f"decode time per step added by each aux round after the first: {per_round}")
    if "peak memory MiB" in report["table"]:
        print(f"peak memory: {report['peak_memory_method']}")
    print(f"val loss: mean next-token NLL over {report['settings']['eval_tokens']} tokens of {len(data_names)} file(s)")
    if report["noisy_timings"]:
        print(noise_warning(report["noisy_timings"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        from .plots import plot_compare

        plot_compare(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
