"""Forward time per decoder layer (the model's forward divided by its layers) of two versions of the model code, side
by side in one run, with and without recorded outputs (`output_hidden_states`, and `output_attentions` where the
backend returns weights).

    python benchmarks/recording_cost.py --before OTHER_CHECKOUT/modeling_dualflow [--rounds 15]

`--before` is the `modeling_dualflow` folder of another checkout (e.g. a git worktree of an earlier commit); "after"
is the one this script imports. Both models get the same weights and must give the same logits. One torch thread,
fp32, no gradients; the aux flow at every position (scoring / training layout). Each round times every case once, in
an order rotated every round, so background load favours no case; the table gives medians.
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

import modeling_dualflow


CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    aux_num_experts_per_tok=2,
    max_position_embeddings=512,
)
CASES = [  # (attention backend, recorded outputs)
    ("eager", ()),
    ("eager", ("hidden_states",)),
    ("eager", ("hidden_states", "attentions")),
    ("sdpa", ()),
    ("sdpa", ("hidden_states",)),
]


def load_package(folder: Path, name: str):
    """The `modeling_dualflow` package in `folder`, imported under `name` (beside the one this script imports)."""
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def forward_seconds(model, input_ids, recorded) -> float:
    flags = {f"output_{name}": True for name in recorded}
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids, **flags)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the modeling_dualflow folder of the other version")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    packages = {"before": load_package(args.before.resolve(), "modeling_dualflow_before"), "after": modeling_dualflow}
    models = {}
    for version, package in packages.items():
        for backend in ("eager", "sdpa"):
            models[version, backend] = package.DualFlowForCausalLM(package.DualFlowConfig(**CONFIG)).eval()
            models[version, backend].set_attn_implementation(backend)
    weights = models["before", "eager"].state_dict()
    for model in models.values():
        model.load_state_dict(weights)
    input_ids = torch.randint(
        0, CONFIG["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        reference = models["before", "eager"](input_ids).logits
        for key, model in models.items():
            torch.testing.assert_close(model(input_ids).logits, reference, rtol=0, atol=1e-4, msg=str(key))

    runs = [(version, backend, recorded) for backend, recorded in CASES for version in packages]
    for version, backend, recorded in runs:  # warm-up
        forward_seconds(models[version, backend], input_ids, recorded)
    times = {run: [] for run in runs}
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for run in runs[shift:] + runs[:shift]:
            version, backend, recorded = run
            times[run].append(forward_seconds(models[version, backend], input_ids, recorded))

    layers = CONFIG["num_hidden_layers"]
    print(f"batch {args.batch} x {args.seq} tokens, aux flow at every position; ms per decoder layer, medians")
    print(f"{'attention':<10} {'recorded':<28} {'before':>8} {'after':>8} {'after/before':>13}")
    for backend, recorded in CASES:
        before, after = (1000 * statistics.median(times[v, backend, recorded]) / layers for v in packages)
        label = " + ".join(recorded) or "nothing"
        print(f"{backend:<10} {label:<28} {before:>8.2f} {after:>8.2f} {after / before:>13.2f}")


if __name__ == "__main__":
    main()
