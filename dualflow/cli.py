"""`dualflow` command line: each subcommand lives in its own module exposing `register(subparsers)`."""

import argparse
import importlib
import sys

from .errors import DualFlowUserError


SUBCOMMAND_MODULES = [
    "dualflow.instruments.demo",
    "dualflow.convert.cli",
    "dualflow.finetune",
    "dualflow.hub",
    "dualflow.instruments.compare",
    "dualflow.instruments.experiment",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dualflow", description="Dual-Flow Transformers for transformers: convert, fine-tune, share and measure."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (DualFlowUserError, FileNotFoundError, ValueError) as error:
        print(f"dualflow {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
