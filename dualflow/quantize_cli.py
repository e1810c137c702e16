"""`dualflow quantize SRC OUT`: command line of `dualflow.quantize` (which imports compressed-tensors)."""

import argparse

from .errors import DualFlowUserError


def build_parser(prog: str = "dualflow quantize") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Write a Dual-Flow checkpoint with its attention projections in compressed-tensors W4A8 "
            "(int4 weights in groups of 128, int8 activations per token), the quantised format vLLM "
            "serves it in; the experts, router, embeddings, lm_head and the aux flow's modules stay as "
            "they are. Needs compressed-tensors (installed with vLLM)."
        ),
    )
    parser.add_argument("src", metavar="SRC", help="a Dual-Flow checkpoint folder (from `dualflow convert`)")
    parser.add_argument("out", metavar="OUT", help="output folder (absent or empty unless --overwrite)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a Dual-Flow model in OUT (once every input is checked)",
    )
    return parser


def run(args) -> int:
    try:
        from .quantize import SCHEME, quantize_checkpoint
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("compressed_tensors"):
            raise
        raise DualFlowUserError(
            "it needs compressed-tensors (vLLM brings it), not installed: pip install compressed-tensors"
        ) from None
    summary = quantize_checkpoint(args.src, args.out, overwrite=args.overwrite)
    print(
        f"wrote {summary['out']}: {SCHEME} (compressed-tensors) on {summary['num_quantised']} attention "
        f"projections of {summary['num_layers']} layers, {summary['total_bytes'] / 1e6:.1f} MB"
    )
    return 0
