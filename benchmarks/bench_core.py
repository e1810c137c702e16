"""Core Dual-Flow costs on CPU, batch 1, side by side in one run (issue 2's targets).

    python benchmarks/bench_core.py [--hidden 384 --layers 6 --experts 16 --top-k 2 --aux-top-k 2 --prompt 512]

Reports prefill time (dual / primary-only), decode time per token (grouped dual / primary-only / two-pass: the aux
flow as a second batched pass over the layers, `dualflow.instruments.two_pass`), and KV-cache bytes (dual vs the base
model's cache); the "R=2" rows time the same weights with `aux_num_rounds=2`. Measurements are interleaved, in an
order rotated every round, and the median is reported, so background load and warm caches favour no variant.
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from dualflow.convert import init_aux_from_primary
from dualflow.instruments.probes import rotated, seconds
from dualflow.instruments.two_pass import TwoPassDualFlow
from modeling_dualflow import DualFlowCache, DualFlowConfig, DualFlowForCausalLM


def add_model_arguments(parser, vocab: int = 32000) -> None:
    """The flags `build_model` reads: the model's shape."""
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--aux-top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=vocab)


def build_model(args, aux_num_rounds: int = 1) -> DualFlowForCausalLM:
    torch.manual_seed(0)
    config = DualFlowConfig(
        aux_num_rounds=aux_num_rounds,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        moe_intermediate_size=args.hidden * 2 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 192),
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        aux_num_experts_per_tok=args.aux_top_k,
        max_position_embeddings=4096,
    )
    model = DualFlowForCausalLM(config).eval()
    init_aux_from_primary(model)
    return model


@torch.inference_mode()
def measure(model, model_r2, args) -> dict:
    prompt = torch.randint(0, args.vocab, (1, args.prompt))

    def prefill(use_aux_flow, model=model):
        return lambda: model(prompt, use_cache=True, logits_to_keep=1, use_aux_flow=use_aux_flow)

    def decode_steps(step, model=model):
        cache = DualFlowCache(config=model.config)
        model(prompt[:, : args.decode_context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens = torch.randint(0, args.vocab, (1, args.decode_tokens))

        def run():
            for index in range(args.decode_tokens):
                step(tokens[:, index : index + 1], cache)
            cache.crop(-args.decode_tokens)

        return run

    def grouped_step(token, cache):
        model(token, past_key_values=cache, use_cache=True)

    def primary_step(token, cache):
        model(token, past_key_values=cache, use_cache=True, use_aux_flow=False)

    def grouped_step_r2(token, cache):
        model_r2(token, past_key_values=cache, use_cache=True)

    two_pass = TwoPassDualFlow(model)

    def two_pass_step(token, cache):
        two_pass(token, cache=cache, logits_to_keep=1)

    variants = {
        "prefill_primary": prefill(False),
        "prefill_dual": prefill(True),
        "decode_primary": decode_steps(primary_step),
        "decode_dual_grouped": decode_steps(grouped_step),
        "decode_two_pass": decode_steps(two_pass_step),
        "prefill_dual_r2": prefill(True, model_r2),
        "decode_dual_grouped_r2": decode_steps(grouped_step_r2, model_r2),
    }
    for fn in variants.values():  # warm-up
        fn()
    samples = {name: [] for name in variants}
    clock = time.process_time if args.cpu_time else time.perf_counter
    for repeat in range(args.repeats):
        for name in rotated(list(variants), repeat):
            samples[name].append(seconds(variants[name], clock=clock))
    result = {name: statistics.median(values) for name, values in samples.items()}
    for name in ("decode_primary", "decode_dual_grouped", "decode_two_pass", "decode_dual_grouped_r2"):
        result[name] /= args.decode_tokens

    dual_cache = model(prompt, use_cache=True, logits_to_keep=1).past_key_values
    base_cache = model(prompt, use_cache=True, logits_to_keep=1, use_aux_flow=False, past_key_values=DynamicCache())
    result["kv_bytes_dual"] = dual_cache.nbytes()
    result["kv_bytes_base"] = sum(
        layer.keys.nbytes + layer.values.nbytes for layer in base_cache.past_key_values.layers
    )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time instead of the wall clock: on a shared machine the wall clock also "
        "counts other processes' turns (use with OMP_NUM_THREADS=1, where CPU time is the work done)",
    )
    args = parser.parse_args()

    model = build_model(args)
    model_r2 = build_model(args, aux_num_rounds=2)
    model_r2.load_state_dict(model.state_dict(), strict=False)  # the same weights; round gates stay 0
    r = measure(model, model_r2, args)
    rows = [
        (f"prefill {args.prompt} tokens", r["prefill_primary"], r["prefill_dual"], None),
        ("decode, per token", r["decode_primary"], r["decode_dual_grouped"], r["decode_two_pass"]),
        (f"prefill {args.prompt}, R=2", r["prefill_primary"], r["prefill_dual_r2"], None),
        ("decode/token, R=2", r["decode_primary"], r["decode_dual_grouped_r2"], None),
    ]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.experts} experts, k_p={args.top_k}, "
        f"k_a={args.aux_top_k}, vocab {args.vocab}; batch 1; torch threads {torch.get_num_threads()}; "
        f"{'process CPU time' if args.cpu_time else 'wall clock'}"
    )
    print(f"{'':22}{'primary-only':>14}{'dual grouped':>14}{'ratio':>8}{'two-pass':>14}{'ratio':>8}")
    for label, primary, dual, two_pass_time in rows:
        two_pass_cells = (
            f"{two_pass_time * 1e3:>12.2f}ms{two_pass_time / primary:>8.2f}" if two_pass_time else f"{'-':>14}{'-':>8}"
        )
        print(f"{label:22}{primary * 1e3:>12.2f}ms{dual * 1e3:>12.2f}ms{dual / primary:>8.2f}{two_pass_cells}")
    print(
        f"{'KV cache bytes':22}{r['kv_bytes_base']:>14}{r['kv_bytes_dual']:>14}{r['kv_bytes_dual'] / r['kv_bytes_base']:>8.2f}"
    )


if __name__ == "__main__":
    main()
