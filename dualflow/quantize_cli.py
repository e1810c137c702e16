"""`dualflow quantize SRC OUT`: command line of `dualflow.quantize` (which imports compressed-tensors)."""

import argparse
from importlib.metadata import PackageNotFoundError, version

from .errors import DualFlowUserError


# The compressed-tensors releases quantize works with: pyproject.toml's `quantize` extra. vLLM (0.32 CPU, 0.33) pins
# 0.17.0; 0.18 writes the same checkpoint; 0.19 changed the interface of the Converter `dualflow.quantize` implements,
# and 0.20 writes a quantization_config that the serving check (`unserved_field`, beside vLLM's 0.17) refuses.
COMPRESSED_TENSORS = ">=0.17,<0.19"
INSTALL = f"pip install 'compressed-tensors{COMPRESSED_TENSORS}'"


def build_parser(prog: str = "dualflow quantize") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Write a Dual-Flow checkpoint with its attention projections in compressed-tensors W4A8 "
            "(int4 weights in groups of 128, int8 activations per token), the quantised format vLLM "
            "serves it in; the experts, router, embeddings, lm_head and the aux flow's modules stay as "
            f"they are. Needs compressed-tensors{COMPRESSED_TENSORS} (installed with vLLM)."
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


def check_compressed_tensors(installed: str | None) -> None:
    """A one-line error unless `installed`, a compressed-tensors version (None: not installed), is in the range."""
    from packaging.specifiers import SpecifierSet

    if installed is None:
        raise DualFlowUserError(f"it needs compressed-tensors (vLLM brings it), not installed: {INSTALL}")
    if not SpecifierSet(COMPRESSED_TENSORS).contains(installed, prereleases=True):
        raise DualFlowUserError(
            f"it works with compressed-tensors{COMPRESSED_TENSORS}, not the installed {installed}: {INSTALL}"
        )


def run(args) -> int:
    try:
        installed = version("compressed-tensors")
    except PackageNotFoundError:
        installed = None
    check_compressed_tensors(installed)
    try:
        from .quantize import SCHEME, quantize_checkpoint
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("compressed_tensors"):
            raise
        check_compressed_tensors(None)  # raises: the metadata of a package that is not there (a broken install)
    from loguru import logger  # compressed-tensors' own logger (it comes with it): a line per file copied

    logger.disable("compressed_tensors")
    try:
        summary = quantize_checkpoint(args.src, args.out, overwrite=args.overwrite)
    finally:
        logger.enable("compressed_tensors")
    print(
        f"wrote {summary['out']}: {SCHEME} (compressed-tensors) on {summary['num_quantised']} attention "
        f"projections of {summary['num_layers']} layers, {summary['total_bytes'] / 1e6:.1f} MB"
    )
    return 0
