"""`dualflow convert SRC OUT`: command-line entry of the checkpoint converter (torch is imported only to convert)."""

import argparse

from . import DTYPE_NAMES, SUPPORTED_MODEL_TYPES


def build_parser(prog: str = "dualflow convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Convert a checkpoint folder or Hub repo id into a Hub-ready Dual-Flow checkpoint whose primary flow is "
            f"exactly the source model. Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        ),
    )
    parser.add_argument("src", metavar="SRC", help="source checkpoint: local folder or Hub repo id")
    parser.add_argument("out", metavar="OUT", help="output folder (absent or empty unless --overwrite)")
    parser.add_argument(
        "--aux-top-k",
        type=int,
        default=None,
        help="experts per token of the aux flow (k_a); default: the source's top-k (exact parity); MoE sources only",
    )
    parser.add_argument(
        "--aux-rounds",
        type=int,
        default=1,
        help="passes of the aux flow through the layers (aux_num_rounds); extra rounds start as the identity "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--aux-adapter-rank",
        type=int,
        default=0,
        help="rank of the aux adapters (low-rank deltas acting on aux rows only; 0 = none); they start at zero "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="auto",
        help="output dtype; auto keeps the source's (default: %(default)s)",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest output shard, e.g. 500MB (default: %(default)s)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="compare logits (aux on/off) and greedy generations with the source; fail on a mismatch",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="empty OUT first if it holds files (once every input is checked)"
    )
    parser.add_argument("--revision", help="for a Hub id: the branch, tag or commit to convert (default: main)")
    parser.add_argument("--token", help="for a Hub id: Hub token (default: HF_TOKEN or the `hf auth login` token)")
    return parser


def run(args) -> int:
    from .converter import convert_checkpoint

    summary = convert_checkpoint(
        args.src,
        args.out,
        aux_top_k=args.aux_top_k,
        aux_rounds=args.aux_rounds,
        aux_adapter_rank=args.aux_adapter_rank,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        verify=args.verify,
        overwrite=args.overwrite,
        revision=args.revision,
        token=args.token,
    )
    experts = (
        f", {summary['num_experts']} experts, k_p={summary['top_k']}, k_a={summary['aux_top_k']}"
        if summary["num_experts"]
        else ", dense"
    )
    print(
        f"wrote {summary['out']}: {summary['model_type']}{experts}; {summary['num_tensors']} tensors in "
        f"{summary['num_shards']} shard(s), {summary['total_bytes'] / 1e6:.1f} MB"
    )
    if summary["parity"] is not None:
        print(f"verify: {summary['parity']['summary']}")
    return 0
