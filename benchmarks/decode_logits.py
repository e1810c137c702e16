"""Decode with and without the primary rows' LM head in `generate` (issue 40.7), side by side in one run.

    python benchmarks/decode_logits.py [--hidden 384 --layers 6 --vocab 8192 --batch 1 16 --tokens 32 --repeats 15]

`generate` with the aux flow on used to compute logits for the primary rows too ("before":
`return_primary_logits=True`); it now computes the predicted (aux) rows' logits only ("after", its default). Both run
beside the aux flow off (the base model), interleaved in an order rotated every repeat, greedy, same prompt and
weights. Prints the median seconds per generated token of each, and the medians of the per-repeat ratios aux on / off
before and after and after / before, with their standard errors (the spread of the per-repeat ratios over
sqrt(repeats)).
"""

import argparse
import statistics
from functools import partial

import torch
from bench_core import add_model_arguments, build_model

from dualflow.instruments.probes import rotated, seconds


@torch.inference_mode()
def measure(model, batch: int, args) -> dict:
    prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    greedy = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    variants = {
        "aux off": dict(use_aux_flow=False),
        "aux on, before": dict(return_primary_logits=True),
        "aux on, after": dict(),
    }
    outputs = {name: model.generate(prompt, **kwargs, **greedy) for name, kwargs in variants.items()}  # warm-up
    assert torch.equal(outputs["aux on, before"], outputs["aux on, after"]), "the two aux runs generated other tokens"
    samples = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name in rotated(list(variants), repeat):
            run = partial(model.generate, prompt, **variants[name], **greedy)
            samples[name].append(seconds(run) / args.tokens)
    return samples


def ratio_summary(numerators, denominators) -> str:
    ratios = [a / b for a, b in zip(numerators, denominators)]
    return f"{statistics.median(ratios):.3f} ± {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, vocab=8192)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    print(
        f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts, k_p {args.top_k}, k_a {args.aux_top_k}, "
        f"vocab {args.vocab}, prompt {args.prompt}, {args.tokens} new tokens, {args.repeats} repeats, "
        f"{args.threads} threads, fp32"
    )
    columns = ("on/off before", "on/off after", "after/before")
    print(f"{'batch':>5} {'off ms/tok':>11} {'before':>8} {'after':>8}" + "".join(f"{c:>16}" for c in columns))
    for batch in args.batch:
        samples = measure(model, batch, args)
        off, before, after = (samples[name] for name in ("aux off", "aux on, before", "aux on, after"))
        print(
            f"{batch:>5} {1e3 * statistics.median(off):>11.2f} {1e3 * statistics.median(before):>8.2f} "
            f"{1e3 * statistics.median(after):>8.2f} {ratio_summary(before, off):>16} {ratio_summary(after, off):>16}"
            f"{ratio_summary(after, before):>16}"
        )


if __name__ == "__main__":
    main()
