"""
`dualflow finetune MODEL --data FILE`: command line of `dualflow.finetune`. Our own flags are parsed here without
torch or transformers (instant --help and argument errors); every other flag goes to `transformers.TrainingArguments`'
own parser, which is imported only to run.
"""

import argparse
import contextlib
import hashlib
import importlib.util
import io
import os
import sys
from importlib import metadata
from pathlib import Path

from .data_paths import check_local_data
from .deepspeed_runs import is_main_process
from .errors import DualFlowUserError
from .quantisation_libraries import import_bitsandbytes


USAGE = "%(prog)s MODEL --data FILE [--output-dir DIR] [options] [TrainingArguments flags]"
# Short spellings kept from earlier versions: flag -> (TrainingArguments field, type).
ALIASES = {
    "--lr": ("learning_rate", float),
    "--epochs": ("num_train_epochs", float),
    "--batch-size": ("per_device_train_batch_size", int),
    "--grad-accum": ("gradient_accumulation_steps", int),
}
TRAINER_FLAGS = (
    "Every transformers.TrainingArguments field is a flag too, spelled --max_steps or --max-steps: --max-steps N, "
    "--bf16, --save-strategy steps --save-steps N, --resume-from-checkpoint DIR, --weight-decay X, ... "
    "(`%(prog)s --help-trainer` lists all of them)."
)


def trainer_parser(prog: str):
    """transformers' parser of TrainingArguments, with this package's defaults (imports transformers)."""
    from transformers import HfArgumentParser, TrainingArguments

    from .finetune import TRAINER_DEFAULTS

    # exit_on_error=False: a bad Trainer flag becomes a DualFlowUserError, not 116 lines of usage.
    parser = HfArgumentParser(TrainingArguments, prog=prog, usage=USAGE, exit_on_error=False)
    parser.set_defaults(**TRAINER_DEFAULTS)
    return parser


def trainer_help(prog: str) -> str:
    """
    TrainingArguments' flags as `--help-trainer` prints them. Rendering them imports transformers' trainer and so
    torch (10 s and more), so the text is cached per transformers and package version.
    """
    versions = f"{prog}\0{metadata.version('transformers')}\0{metadata.version('dualflow-transformers')}"
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cached = cache_home / "dualflow" / f"help-trainer-{hashlib.sha256(versions.encode()).hexdigest()[:16]}.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = trainer_parser(prog).format_help()
    try:  # an unwritable cache only costs the next call its 10 s
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, cached)
    except OSError:
        pass
    return text


class TrainerHelp(argparse.Action):
    """--help-trainer: print every TrainingArguments flag and exit."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(trainer_help(parser.prog), end="")
        parser.exit()


class FinetuneParser(argparse.ArgumentParser):
    """Parses our own flags; the flags it does not know are kept in `trainer_flags` for TrainingArguments."""

    def parse_args(self, args=None, namespace=None):
        namespace, trainer_flags = self.parse_known_args(args, namespace)
        namespace.trainer_flags = trainer_flags
        return namespace


def build_parser(prog: str = "dualflow finetune") -> FinetuneParser:
    parser = FinetuneParser(
        prog=prog,
        usage=USAGE,
        description="Fine-tune a Dual-Flow model on text or chat data with transformers.Trainer: all weights (default), "
        "--aux-only or --lora.",
        epilog=TRAINER_FLAGS,
        allow_abbrev=False,  # a prefix of one of our flags must not swallow a Trainer flag
    )
    parser.add_argument("model", help="Dual-Flow model folder (or Hub id) with a tokenizer")
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="data files (.txt, .jsonl, .json, .parquet, .csv, .tsv, .arrow), folders, saved datasets or Hub dataset "
        "ids; rows hold a text or a chat (messages)",
    )
    parser.add_argument(
        "--data-split",
        "--data_split",
        default="train",
        help="split of a dataset (train)",
    )
    parser.add_argument(
        "--data-config",
        "--data_config",
        help="config (subset) of a dataset",
    )
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="read the data as it is packed; with --max-steps, only what those steps need",
    )
    parser.add_argument(
        "--data-name",
        "--data_name",
        help="the data's name in the model card, e.g. a Hub dataset id (file names are never published)",
    )
    parser.add_argument(
        "--text-field",
        "--text_field",
        default="text",
        help='the field that holds a row\'s text ("text")',
    )
    parser.add_argument(
        "--output-dir", "--output_dir", help="where to save the result (default: ./<model name>-finetuned or -lora)"
    )
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters + the aux parameters; saves the adapter"
    )
    parser.add_argument(
        "--load-in-4bit",
        "--load_in_4bit",
        action="store_true",
        help="with --lora: QLoRA, the linear layers loaded in 4 bits (NF4, bitsandbytes) under the adapters",
    )
    parser.add_argument(
        "--aux-only",
        "--aux_only",
        action="store_true",
        help="train only the aux flow's own parameters (embedding, couplings, round gates, adapters)",
    )
    parser.add_argument(
        "--block-size",
        "--block_size",
        type=int,
        default=512,
        help="tokens per training block, capped at the model's (512)",
    )
    parser.add_argument(
        "--eval-fraction",
        "--eval_fraction",
        type=float,
        default=0.1,
        help="share of blocks held out for evaluation (0.1)",
    )
    parser.add_argument(
        "--eval-blocks",
        "--eval_blocks",
        dest="eval_blocks_max",
        type=int,
        help="measure the eval NLL before / after training on at most this many of the held-out blocks (all; 0: skip the measurement)",
    )
    parser.add_argument("--lora-r", "--lora_r", type=int, default=16, help="LoRA rank (16)")
    parser.add_argument("--lora-alpha", "--lora_alpha", type=int, default=32, help="LoRA alpha (32)")
    parser.add_argument("--lora-dropout", "--lora_dropout", type=float, default=0.0, help="LoRA dropout (0)")
    parser.add_argument(
        "--target-modules",
        "--target_modules",
        nargs="+",
        help="modules LoRA adapts, e.g. q_proj v_proj ('experts': the fused MoE experts); default: every attention, "
        "MLP and expert projection",
    )
    for flag, (name, kind) in ALIASES.items():
        parser.add_argument(flag, dest=name, type=kind, help=f"alias of --{name.replace('_', '-')}")
    parser.add_argument("--help-trainer", action=TrainerHelp, help="list every TrainingArguments flag and exit")
    parser.set_defaults(prog=prog)
    return parser


def quantisation_libraries(args: argparse.Namespace) -> tuple[str, ...]:
    return ("bitsandbytes",) if args.load_in_4bit and args.lora else ()


def run(args: argparse.Namespace) -> int:
    check_local_data(args.data)  # before the imports of a run (seconds): a mistyped path is refused at once
    if quantisation_libraries(args) and importlib.util.find_spec("bitsandbytes") is not None:
        # before transformers' Trainer imports PEFT, which imports bitsandbytes and lets it speak
        note = import_bitsandbytes()
        if note:
            print(note, file=sys.stderr)
    from .finetune import finetune

    options = dict(vars(args))
    prog, trainer_flags, model = options.pop("prog"), options.pop("trainer_flags"), options.pop("model")
    try:
        training, unknown = trainer_parser(prog).parse_known_args(trainer_flags)
    except argparse.ArgumentError as error:
        raise DualFlowUserError(str(error)) from None
    if unknown:
        raise DualFlowUserError(
            f"unrecognized arguments: {' '.join(unknown)} (see {prog} --help and {prog} --help-trainer)"
        )
    training = vars(training)
    del training["output_dir"]  # ours: --output-dir, which defaults to the model's name
    for name, _ in ALIASES.values():
        value = options.pop(name)
        if value is not None:
            training[name] = value
    suffix = "lora" if options["lora"] else "finetuned"
    # `dualflow finetune .` names the output after the model folder, not after "."
    model_name = Path(model).resolve().name if Path(model).is_dir() else Path(model).name
    output_dir = options.pop("output_dir") or f"{model_name}-{suffix}"
    # Launched as several processes (torchrun, DeepSpeed), the main one alone speaks; errors still go to stderr.
    quiet = contextlib.redirect_stdout(io.StringIO()) if not is_main_process() else contextlib.nullcontext()
    with quiet:
        finetune(model, options.pop("data"), output_dir, **options, **training)
    return 0
