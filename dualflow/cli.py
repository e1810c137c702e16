"""
`dualflow` command line. Each subcommand lives in its own module exposing `build_parser(prog)` and `run(args)`; only
the module of the command being run is imported, and it imports torch and transformers only in `run`, so `--help` and
argument errors are instant. bitsandbytes and torchao stay out of a command that does not quantise (a module's
`quantisation_libraries(args)` names those it uses). A DualFlowUserError (the user's mistake), Ctrl-C, SIGTERM or SIGHUP (`kill`, `timeout`, a job
scheduler) ends in one line; any other exception is a bug in our code and keeps its traceback.
"""

import argparse
import importlib
import signal
import sys
from importlib.metadata import version

from .deepspeed_runs import is_main_process
from .errors import DualFlowUserError, terminating_signals_as_interrupt
from .quantisation_libraries import quantisation_libraries_left_out


# name: (module, one-line help)
COMMANDS = {
    "demo": (
        "dualflow.instruments.demo",
        "build, convert, generate and compare a tiny MoE (offline, no downloads; a few minutes on a CPU)",
    ),
    "convert": ("dualflow.convert.cli", "upcycle a transformers checkpoint into a Dual-Flow checkpoint"),
    "quantize": (
        "dualflow.quantize_cli",
        "write a Dual-Flow checkpoint in compressed-tensors W4A8 (attention projections), for vLLM",
    ),
    "finetune": (
        "dualflow.finetune_cli",
        "fine-tune a Dual-Flow model on text or chat data (files, folders, datasets) with transformers.Trainer",
    ),
    "push": ("dualflow.hub", "upload a Dual-Flow model (or LoRA adapter) folder to the Hugging Face Hub"),
    "compare": (
        "dualflow.instruments.compare",
        "measure prefill, decode, KV cache, memory and loss: primary-only vs dual-flow vs alternatives",
    ),
    "experiment": (
        "dualflow.instruments.experiment",
        "train tiny MoE LMs from scratch: single-flow vs dual-flow arms, same tokens and seeds",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the commands (each command's own parser comes from its module)."""
    parser = argparse.ArgumentParser(
        prog="dualflow", description="Dual-Flow Transformers for transformers: convert, fine-tune, share and measure."
    )
    parser.add_argument("--version", action="version", version=f"dualflow {version('dualflow-transformers')}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def close_progress_bars() -> None:
    """
    Clear the progress bars still open (Trainer's, when a run stops inside it): left open, tqdm redraws them when the
    interpreter exits, after the one line that says how the command ended.
    """
    tqdm_module = sys.modules.get("tqdm.std")  # none to close if tqdm was never imported
    if tqdm_module is None:
        return
    for bar in list(tqdm_module.tqdm._instances):
        bar.leave = False
        bar.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints the help or the usage error and exits
    command = argv[0]
    with terminating_signals_as_interrupt() as signals:
        try:
            module = importlib.import_module(COMMANDS[command][0])
            args = module.build_parser(f"dualflow {command}").parse_args(argv[1:])
            # a command names the quantisation libraries it uses (`quantisation_libraries(args)`); the others stay out
            keep = module.quantisation_libraries(args) if hasattr(module, "quantisation_libraries") else ()
            with quantisation_libraries_left_out(keep):
                return module.run(args) or 0
        except DualFlowUserError as error:
            close_progress_bars()
            print(f"dualflow {command}: error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM or SIGHUP: what was kept, if anything, no traceback
            return ended_by_signal(command, signals, interrupt)
        except Exception:
            if signals.signum is None and not signals.interrupted:
                raise
            # the signal landed in a library's native code (safetensors' reads), which reported an error of its own
            return ended_by_signal(command, signals, KeyboardInterrupt())


def ended_by_signal(command: str, signals, interrupt: KeyboardInterrupt) -> int:
    """The one line of a command ended by Ctrl-C, SIGTERM or SIGHUP, and its exit status."""
    close_progress_bars()
    new_line = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
    if signals.signum is None:
        how, status = "interrupted", 130
    else:  # the shell's status for a process killed by that signal
        how, status = f"terminated ({signal.Signals(signals.signum).name})", 128 + signals.signum
    if is_main_process():  # a launcher's other processes (torchrun, DeepSpeed) got the same signal: one line in all
        print(f"{new_line}dualflow {command}: {how}{f'; {interrupt}' if str(interrupt) else ''}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
