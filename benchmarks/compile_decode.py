"""Decode step with a `StaticCache`, eager vs `torch.compile(fullgraph=True)`, batch 1 (issue 5, item 5).

    python benchmarks/compile_decode.py [--hidden 128 --layers 4 --experts 8 --top-k 2 --aux-top-k 3 --threads 1]

Greedy-decodes `--steps` tokens after a 16-token prompt with each variant, checks that both pick the same tokens, and
reports the median time per decode step, interleaving the variants' rounds so background load hits both alike. The
first compiled call includes the compilation, reported separately.
"""

import argparse
import statistics
import time

import torch
from transformers import StaticCache

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM


PROMPT_LENGTH = 16


def build_model(args) -> DualFlowForCausalLM:
    torch.manual_seed(0)
    config = DualFlowConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        aux_num_experts_per_tok=args.aux_top_k,
    )
    model = DualFlowForCausalLM(config).eval()
    with torch.no_grad():  # non-zero couplings: the aux flow differs from the primary one
        for name, parameter in model.named_parameters():
            if name in set(model.aux_parameter_names()) and "aux_embed_tokens" not in name:
                parameter.normal_(std=0.5)
    return model


def greedy_decode(model, step, steps: int) -> tuple[list[int], list[float]]:
    """Tokens and seconds per decode step; `step(tokens, cache, position_ids)` returns the next-token logits."""
    prompt = torch.arange(1, PROMPT_LENGTH + 1).unsqueeze(0)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_LENGTH + steps)
    tokens, seconds = [], []
    with torch.no_grad():
        token = model(prompt, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for index in range(steps):
            start = time.perf_counter()
            logits = step(token, cache, torch.tensor([[PROMPT_LENGTH + index]]))
            token = logits[:, -1:].argmax(-1)
            seconds.append(time.perf_counter() - start)
            tokens.append(int(token))
    return tokens, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--aux-top-k", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more oversubscribe a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(args)

    def eager(token, cache, position_ids):
        return model(token, past_key_values=cache, position_ids=position_ids, logits_to_keep=1).logits

    compiled = torch.compile(eager, fullgraph=True)
    start = time.perf_counter()
    compiled_tokens, _ = greedy_decode(model, compiled, args.steps)
    first_call = time.perf_counter() - start

    per_step = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        eager_tokens, seconds = greedy_decode(model, eager, args.steps)
        per_step["eager"].extend(seconds[1:])
        _, seconds = greedy_decode(model, compiled, args.steps)
        per_step["compiled"].extend(seconds[1:])
    eager_ms = statistics.median(per_step["eager"]) * 1e3
    compiled_ms = statistics.median(per_step["compiled"]) * 1e3
    print(
        f"decode step, median of {len(per_step['eager'])}: eager {eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms "
        f"({eager_ms / compiled_ms:.2f}x); first compiled run incl. compilation {first_call:.1f} s; "
        f"same greedy tokens: {eager_tokens == compiled_tokens}"
    )


if __name__ == "__main__":
    main()
