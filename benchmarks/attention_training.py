"""Training step with the aux flow at every position: aux rows as extra query heads vs the stacked-rows mask path.

    OMP_NUM_THREADS=1 python benchmarks/attention_training.py --cpu-time [--lengths 1024 2048 --repeats 5]

"heads" is the model's path: one causal sdpa call per layer, the aux queries as extra query heads over the same keys
and values, no mask. "stacked mask" is the path before it, rebuilt here as an attention function: the aux rows stacked
under the primary rows as (2T) query rows, with the (2T) x T boolean mask they need. Forward + backward of
`model(ids, labels=ids).loss`, batch 1, no padding; the two variants alternate, medians reported; peak memory is the
process's peak RSS above what it held before the step (Linux VmHWM), the median of `--repeats` steps.
"""

import argparse
import statistics
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dualflow.instruments.probes import peak_memory_bytes
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM
from modeling_dualflow.attention_dualflow import DualFlowQueryHeadGroups


def stacked_mask_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """
    The former path for the aux rows at every position: (batch, 2 * heads, T, d) query heads back to (batch, heads,
    2T, d) stacked rows, each aux row given its position's causal mask row in a (2T) x T mask.
    """
    if not isinstance(module, DualFlowQueryHeadGroups):
        raise ValueError("stacked_mask_sdpa rebuilds the calls with the aux rows as query heads only")
    batch, heads2, length, dim = query.shape
    group, kv_heads = module.num_key_value_groups // 2, key.shape[1]
    stacked = query.reshape(batch, kv_heads, 2, group, length, dim).transpose(2, 3).reshape(batch, -1, 2 * length, dim)
    positions = torch.arange(length, device=query.device)
    mask = positions[None, :] <= torch.cat([positions, positions])[:, None]  # (2T, T)
    output = torch.nn.functional.scaled_dot_product_attention(
        stacked, repeat_kv(key, group), repeat_kv(value, group), attn_mask=mask[None, None], scale=scaling
    )
    output = output.reshape(batch, kv_heads, group, 2, length, dim).transpose(2, 3)
    return output.reshape(batch, heads2, length, dim).transpose(1, 2), None


def build_model(args) -> DualFlowForCausalLM:
    torch.manual_seed(0)
    config = DualFlowConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        num_experts=args.experts,
        num_experts_per_tok=2,
        aux_num_experts_per_tok=2,
        max_position_embeddings=max(args.lengths),
    )
    return DualFlowForCausalLM(config).train()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time instead of the wall clock")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    AttentionInterface.register("stacked_mask_sdpa", stacked_mask_sdpa)
    AttentionMaskInterface.register("stacked_mask_sdpa", sdpa_mask)
    model = build_model(args)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-2 (both flows), vocab "
        f"{args.vocab}, {model.config.num_attention_heads} heads / {model.config.num_key_value_heads} kv heads; "
        f"batch 1, fp32; torch threads {torch.get_num_threads()}; {'process CPU time' if args.cpu_time else 'wall'}"
    )
    print(f"{'T':>6}{'heads s':>10}{'stacked s':>11}{'ratio':>7}{'heads MiB':>11}{'stacked MiB':>13}")
    for length in args.lengths:
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))

        def step(implementation, ids=ids):
            model.set_attn_implementation(implementation)
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()

        variants = {"heads": lambda: step("sdpa"), "stacked": lambda: step("stacked_mask_sdpa")}
        for fn in variants.values():  # warm-up
            fn()
        seconds = {name: [] for name in variants}
        memory = {name: [] for name in variants}
        names = list(variants)
        for repeat in range(args.repeats):
            for name in names[repeat % 2 :] + names[: repeat % 2]:
                start = clock()
                variants[name]()
                seconds[name].append(clock() - start)
                memory[name].append(peak_memory_bytes(variants[name], torch.device("cpu"))[1])
        s = {name: statistics.median(values) for name, values in seconds.items()}
        m = {name: statistics.median(values) / 2**20 for name, values in memory.items()}
        print(
            f"{length:>6}{s['heads']:>10.2f}{s['stacked']:>11.2f}{s['heads'] / s['stacked']:>7.2f}"
            f"{m['heads']:>11.0f}{m['stacked']:>13.0f}"
        )


if __name__ == "__main__":
    main()
