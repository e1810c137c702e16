"""`dualflow demo`: the whole path on a fresh machine, no downloads (a few minutes on a CPU).

1. build a tiny Qwen3-MoE with transformers' own class (random weights, byte-level vocabulary) and save it;
2. convert it to Dual-Flow with `convert_checkpoint` (aux top-k 4 > primary top-k 2);
3. load the result with `AutoModelForCausalLM` + `trust_remote_code`, generate with the aux flow off and on;
4. print a short `dualflow compare` table.
"""

import argparse
import tempfile
from pathlib import Path

from ..errors import DualFlowUserError


# torch and transformers are imported in the functions that use them, so that `dualflow demo --help` is instant.
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 12
# CompareSettings fields of the short `dualflow compare` in step 4.
DEMO_SETTINGS = dict(
    prompt_lengths=(32, 256), batch_sizes=(1, 4), decode_tokens=8, repeats=3, eval_block_size=128, eval_blocks=8
)


def tiny_qwen3_moe(folder: Path) -> Path:
    """A random tiny Qwen3-MoE (8 experts, top-2) saved the way transformers saves any model."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from .data import BYTE_VOCAB_SIZE

    config = Qwen3MoeConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return folder


def _generate(model, prompt_ids, **kwargs) -> list[int]:
    output = model.generate(prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs)
    return output[0, prompt_ids.shape[1] :].tolist()


def build_parser(prog: str = "dualflow demo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--out", help="keep the converted checkpoint in this folder (default: a temporary one)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEMO_SETTINGS["repeats"],
        help=f"interleaved repeats per timing in step 4 (median; default {DEMO_SETTINGS['repeats']})",
    )
    return parser


def run(args) -> int:
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        raise DualFlowUserError(f"--repeats and --threads must be >= 1, got {args.repeats} and {args.threads}")
    import torch
    from transformers import AutoModelForCausalLM

    from ..convert import convert_checkpoint
    from .data import decode_bytes, encode_bytes
    from .inputs import data_tokens, load_checkpoint
    from .measure import CompareSettings, compare_report, noise_warning

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = CompareSettings(**{**DEMO_SETTINGS, "repeats": args.repeats})
    with tempfile.TemporaryDirectory(prefix="dualflow-demo-") as tmp:
        source = tiny_qwen3_moe(Path(tmp) / "tiny-qwen3-moe")
        print(f"1. built a random tiny Qwen3MoeForCausalLM (8 experts, top-2) in {source}")
        converted = Path(args.out) if args.out else Path(tmp) / "tiny-dualflow"
        result = convert_checkpoint(
            source, converted, aux_top_k=4, verify=True, overwrite=args.overwrite, show_progress=False
        )
        print(f"2. converted to Dual-Flow (k_p=2, k_a=4) in {converted}")
        print("   --verify (primary flow vs the source model; at k_a=4 the aux flow may differ):")
        print(f"   {result['parity']['summary']}")

        model = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True).eval()
        prompt_ids = torch.tensor([encode_bytes(PROMPT)])
        runs = {
            "aux off (primary = source model)": {"use_aux_flow": False},
            "aux on, k_a=2 (= k_p: upcycled, untrained)": {"use_aux_flow": True, "aux_num_experts_per_tok": 2},
            "aux on, k_a=4 (more decode compute)": {"use_aux_flow": True},
        }
        print(
            f"3. loaded with AutoModelForCausalLM(trust_remote_code=True): {type(model).__name__}; "
            f"greedy {NEW_TOKENS} tokens after {PROMPT!r} (random weights, so the text is noise):"
        )
        generations = {label: _generate(model, prompt_ids, **kwargs) for label, kwargs in runs.items()}
        for label, tokens in generations.items():
            print(f"   {label:<44} ids {tokens}  text {decode_bytes(tokens)!r}")
        labels = list(generations)
        same = generations[labels[0]] == generations[labels[1]]
        print(f"   aux on with k_a = k_p reproduces the source model: {'yes' if same else 'NO'}")

        print("4. dualflow compare on the converted checkpoint (byte-level stdlib text):")
        measured_model, tokenizer = load_checkpoint(converted)
        tokens, data_names = data_tokens(None, tokenizer)
        report = compare_report(measured_model, str(converted), data_names, tokens, settings)
        print(report["table"])
        print(
            f"   timings: medians of {settings.repeats} repeats (ratio to primary-only, range over repeats), "
            f"torch threads: {torch.get_num_threads()}"
        )
        if report["noisy_timings"]:
            print("   " + noise_warning(report["noisy_timings"]))
        print("   (untrained aux flow: expect little quality difference; ratios show what the aux flow costs)")
        print("next: `dualflow compare` for the full measurement, `dualflow experiment --quick` to train tiny arms.")
    return 0
