"""Dual-Flow in vLLM: what the aux flow costs, and vLLM against transformers' generate (issue 10).

    .venv-vllm/bin/python benchmarks/vllm_throughput.py                 # CPU: small Mixtral-like model, float32
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --preset gpu    # GPU: Mixtral-8x7B layer shapes, bfloat16
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --quantised --prefill-lengths --no-transformers

One random checkpoint (saved once), three vLLM engines over it: the primary flow alone (`use_aux_flow=False`, the
base model), the aux flow with k_a = k_p, and with k_a = 2 k_p. Each round measures every engine on the same fresh
random prompts (prefix caching off, so no engine reuses another round's prompts), in an order rotated every round;
the table gives per-arm medians and the median of the per-round ratios with its standard error.
    prefill: tokens/s of prompts of --prefill-lengths tokens, 1 generated token;
    decode: generated tokens/s for --decode-batches requests of --decode-prompt tokens, --decode-tokens each (wall
        time of the whole requests: the prompts' prefill is in it, the same for every arm);
    decode only: the same requests from the step that gave every request its first token to the last token (vLLM's
        per-request timestamps; a batch's prompts are prefilled in one step), so long prompts' prefill is not in it;
    transformers: `generate` with the aux flow on (k_a = k_p), same prompts, one batch, against vLLM's aux engine;
    byte limit: per decode batch and aux arm, the distinct experts per layer and step of the primary rows and of the
        primary + aux rows, and the decode ratio aux on / off that the bytes a step must stream allow
        (`decode_byte_limit`; routing counted on at most ROUTING_SAMPLE_PROMPT tokens of prompt, the K/V at the
        full context). Long context: e.g. `--decode-prompt 4096 --decode-batches 16 --no-transformers`.

With --quantised the arms are the checkpoint and its `dualflow quantize` copy (compressed-tensors W4A8 on
the attention projections), each with the aux flow off and on (k_a = k_p); the table adds the quantised /
unquantised ratios and the bytes of weights a decode step reads (`decode_weight_bytes`).
"""

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dualflow.instruments.probes import rotated, seconds
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM
from modeling_dualflow.modeling_dualflow import route_two_top_k


PRESETS = {
    # Mixtral's per-layer shapes (hidden 4096, 32/8 heads, 8 experts of 14336, top-2), fewer layers.
    "gpu": dict(
        hidden=4096, heads=32, kv_heads=8, experts=8, expert_size=14336, layers=8, vocab=32000, dtype="bfloat16"
    ),
    # The same proportions at a size two CPU cores measure in minutes.
    "cpu": dict(hidden=512, heads=8, kv_heads=2, experts=8, expert_size=1792, layers=4, vocab=32000, dtype="float32"),
}
TOP_K = 2
# The byte limit's transformers forward (full logits) would not fit at 16 x 8k tokens; routing at a decode step does
# not depend on how long the context is, so it is counted on a prompt this long and the K/V at the real context.
ROUTING_SAMPLE_PROMPT = 256
AUX_ARMS = {"aux k_a=k_p": TOP_K, "aux k_a=2k_p": 2 * TOP_K}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--prefill-lengths", type=int, nargs="*", default=[512, 2048], help="none: no prefill measurement"
    )
    parser.add_argument("--prefill-requests", type=int, default=2, help="prompts per prefill measurement")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-prompt", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile in vLLM")
    parser.add_argument(
        "--quantised", action="store_true", help="the checkpoint against its W4A8 copy (`dualflow quantize`)"
    )
    parser.add_argument(
        "--no-transformers", action="store_true", help="skip transformers' generate (slow at long prompts on a CPU)"
    )
    args = parser.parse_args()
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2: the decode-only rate counts the tokens after the first")
    return args


def model_fields(preset: dict) -> dict:
    """A preset's shape as transformers' MoE config fields (k_p = TOP_K)."""
    return dict(
        vocab_size=preset["vocab"],
        hidden_size=preset["hidden"],
        intermediate_size=preset["expert_size"],
        moe_intermediate_size=preset["expert_size"],
        num_hidden_layers=preset["layers"],
        num_attention_heads=preset["heads"],
        num_key_value_heads=preset["kv_heads"],
        num_experts=preset["experts"],
        num_experts_per_tok=TOP_K,
    )


def save_random_checkpoint(preset: dict, folder: Path) -> DualFlowForCausalLM:
    torch.manual_seed(0)
    config = DualFlowConfig(
        **model_fields(preset),
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    model = DualFlowForCausalLM(config).to(getattr(torch, preset["dtype"])).eval()
    with torch.no_grad():  # an aux flow that differs from the primary one, as after fine-tuning
        for layer in model.model.layers:
            layer.aux_coupling.weight.normal_(std=0.1)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def decode_byte_limit(
    model, sequences: torch.Tensor, prompt_length: int, aux_top_k: int, context_offset: int = 0
) -> dict:
    """
    What a decode step of `sequences` (batch, prompt + new tokens; a step = one position across the batch) must stream
    at the least, with the aux flow on and off: every non-expert weight (the aux embedding: one row per request), the
    distinct experts its rows route to (by `route_two_top_k`, from transformers' router logits on the same
    sequences) and the K/V of the context, read once. Medians over the steps and layers. `context_offset`: context
    tokens beyond `sequences`' own (their prompt stands for a longer one).
    """
    config = model.config
    batch, length = sequences.shape
    out = model(sequences, output_router_logits=True, aux_num_experts_per_tok=aux_top_k)
    experts = model.model.layers[0].mlp.experts
    expert_bytes = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.down_proj.element_size()
    all_expert_bytes = expert_bytes * config.num_experts * config.num_hidden_layers
    aux_only = {"model.aux_embed_tokens.weight"}
    dense_bytes = (
        sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in aux_only) - all_expert_bytes
    )
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    kv_per_token *= experts.down_proj.element_size()
    distinct = {"off": [], "on": []}
    ratios = []
    for step in range(prompt_length, length):
        rows = torch.arange(batch) * length + step  # this step's row of each sequence
        step_bytes = {}
        for flow, with_aux in (("off", False), ("on", True)):
            count = 0
            for primary_logits, aux_logits in zip(out.router_logits, out.aux_router_logits):
                logits = torch.cat([primary_logits[rows], aux_logits[rows]]) if with_aux else primary_logits[rows]
                is_aux_row = torch.arange(len(logits)) >= batch
                top_k = aux_top_k if with_aux else config.num_experts_per_tok
                _, indices = route_two_top_k(
                    logits.float().softmax(-1), is_aux_row, config.num_experts_per_tok, top_k, config.norm_topk_prob
                )
                count += indices.unique().numel()
            distinct[flow].append(count / config.num_hidden_layers)
            context = batch * (step + 1 + context_offset) * kv_per_token
            step_bytes[flow] = dense_bytes + count * expert_bytes + context
        ratios.append(step_bytes["off"] / step_bytes["on"])
    return {
        "primary experts": statistics.median(distinct["off"]),
        "primary + aux experts": statistics.median(distinct["on"]),
        "byte limit": statistics.median(ratios),
    }


def decode_weight_bytes(folder: Path, experts_per_layer: float, batch: int, aux: bool) -> float:
    """
    Bytes of weights a decode step of `batch` requests reads, from the checkpoint's tensors as vLLM's CPU
    build holds them (a W4A8 weight at 4 bits with bfloat16 group scales: its int8 storage is repacked at
    load): each embedding's rows of the batch, `experts_per_layer` experts in each MoE layer, the aux flow's
    own weights only with `aux`, everything else whole. K/V not counted.
    """
    with open(folder / "model.safetensors", "rb") as file:  # the header: name -> dtype, shape, offsets
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    header.pop("__metadata__", None)
    num_experts = json.loads((folder / "config.json").read_text())["num_experts"]
    total = 0.0
    for name, entry in header.items():
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        if name.endswith(".weight_scale"):
            size = math.prod(entry["shape"]) * 2
        elif name.removesuffix(".weight") + ".weight_scale" in header:
            size = math.prod(entry["shape"]) / 2
        if "aux_" in name and not aux:
            continue
        if name.endswith("embed_tokens.weight"):
            size *= batch / entry["shape"][0]
        elif ".mlp.experts." in name:
            size *= experts_per_layer / num_experts
        total += size
    return total


def run_vllm(engine, batch: list[list[int]], max_tokens: int):
    """Greedy completions of token-id prompts, `max_tokens` each (no end-of-sequence stop)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def decode_only_seconds(outputs) -> float:
    """From the step that gave every request its first token to the last token of any (engine timestamps)."""
    first = max(output.metrics.first_token_ts for output in outputs)
    return max(output.metrics.last_token_ts for output in outputs) - first


def summarize(name: str, rates: dict, baseline: str, arms: list[str]) -> list[str]:
    """Rows: per-arm median rate, and the median per-round ratio to `baseline` with its standard error."""
    rows = []
    for arm in arms:
        median = statistics.median(rates[arm])
        if arm == baseline:
            rows.append(f"| {name} | {arm} | {median:,.0f} | 1 (baseline) |")
            continue
        logs = [math.log(a / b) for a, b in zip(rates[arm], rates[baseline])]
        ratio = math.exp(statistics.median(logs))
        stderr = ratio * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
        rows.append(f"| {name} | {arm} | {median:,.0f} | {ratio:.3f} ± {stderr:.3f} |")
    return rows


def quantised_rows(size: int, decode: dict, decode_only: dict, experts: dict, served: dict) -> list[str]:
    """--quantised: per flow, W4A8 against unquantised, and the bytes of weights each arm's step reads."""
    rows = []
    for base in ("primary only", "aux k_a=k_p"):
        pair = [base, f"W4A8 {base}"]
        for name, rates in (("decode", decode), ("decode only", decode_only)):
            by_arm = {arm: rates[size][arm] for arm in pair}
            rows += summarize(f"{name}, batch {size}, W4A8 against unquantised", by_arm, base, pair)
    for arm, (checkpoint, override) in served.items():
        aux = "use_aux_flow" not in override
        count = experts["primary + aux experts" if aux else "primary experts"]
        mib = decode_weight_bytes(checkpoint, count, size, aux) / 2**20
        rows.append(f"| decode, batch {size}, weights read per step | {arm} | {mib:.1f} MiB | |")
    return rows


def main():
    args = parse_args()
    # The checkpoint (534 MB for the CPU preset, GBs for the GPU one) lives only as long as the run.
    with tempfile.TemporaryDirectory(prefix="dualflow-vllm-bench-") as folder:
        measure(args, Path(folder))


def measure(args, root: Path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    preset = PRESETS[args.preset]
    folder = root / "dualflow"
    hf_model = save_random_checkpoint(preset, folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_model.to(device)
    longest = max(args.prefill_lengths + [args.decode_prompt + args.decode_tokens])
    engine_args = dict(
        dtype=preset["dtype"],
        max_model_len=longest + 16,
        # a decode batch's prompts in one step, so every request's first token comes from the same step
        max_num_batched_tokens=max(longest + 16, 2048, max(args.decode_batches) * (args.decode_prompt + 16)),
        disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics) for the decode-only rate
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        skip_tokenizer_init=True,
        seed=0,
    )
    overrides = {"primary only": {"use_aux_flow": False}}
    overrides.update({arm: {"aux_num_experts_per_tok": aux_top_k} for arm, aux_top_k in AUX_ARMS.items()})
    # arm -> (checkpoint, engine overrides)
    served = {arm: (folder, override) for arm, override in overrides.items()}
    if args.quantised:
        from dualflow.quantize import quantize_checkpoint

        quantised = quantize_checkpoint(folder, root / "w4a8")["out"]
        served = {
            f"{prefix}{arm}": (checkpoint, overrides[arm])
            for prefix, checkpoint in (("", folder), ("W4A8 ", quantised))
            for arm in ("primary only", "aux k_a=k_p")
        }
    engines = {
        arm: LLM(model=str(checkpoint), hf_overrides=override, **engine_args)
        for arm, (checkpoint, override) in served.items()
    }
    arms = list(engines)
    aux_arms = {arm: aux_top_k for arm, aux_top_k in AUX_ARMS.items() if arm in engines}
    generator = torch.Generator().manual_seed(1)

    def prompts(count, length):
        return torch.randint(0, preset["vocab"], (count, length), generator=generator).tolist()

    def byte_limits(size, aux_top_k):
        sample_prompt = min(args.decode_prompt, ROUTING_SAMPLE_PROMPT)
        sequences = torch.tensor(prompts(size, sample_prompt + args.decode_tokens), device=device)
        offset = args.decode_prompt - sample_prompt
        return decode_byte_limit(hf_model, sequences, sample_prompt, aux_top_k, context_offset=offset)

    def run_hf(batch, max_tokens):
        ids = torch.tensor(batch, device=device)
        hf_model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)

    for engine in engines.values():  # warm-up
        run_vllm(engine, prompts(1, 64), 4)
    if not args.no_transformers:
        run_hf(prompts(1, 16), 2)

    prefill = {n: {arm: [] for arm in arms} for n in args.prefill_lengths}
    decode = {b: {arm: [] for arm in arms + ["transformers generate"]} for b in args.decode_batches}
    decode_only = {b: {arm: [] for arm in arms} for b in args.decode_batches}
    for round_index in range(args.rounds):
        order = rotated(arms, round_index)
        for length in args.prefill_lengths:
            batch = prompts(args.prefill_requests, length)
            for arm in order:
                elapsed = seconds(run_vllm, engines[arm], batch, 1)
                prefill[length][arm].append(len(batch) * length / elapsed)
        for size in args.decode_batches:
            batch = prompts(size, args.decode_prompt)
            new_tokens = size * args.decode_tokens
            for arm in order:
                start = time.perf_counter()
                outputs = run_vllm(engines[arm], batch, args.decode_tokens)
                decode[size][arm].append(new_tokens / (time.perf_counter() - start))
                decode_only[size][arm].append(size * (args.decode_tokens - 1) / decode_only_seconds(outputs))
            if not args.no_transformers:
                elapsed = seconds(run_hf, batch, args.decode_tokens)
                decode[size]["transformers generate"].append(new_tokens / elapsed)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)

    name = "GPU" if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(
        f"\n{args.preset} preset on {name}: hidden {preset['hidden']}, {preset['layers']} layers, "
        f"{preset['experts']} experts of {preset['expert_size']}, k_p={TOP_K}, {preset['dtype']}; "
        f"decode prompts of {args.decode_prompt} tokens; {args.rounds} interleaved rounds, medians\n"
    )
    print("| measurement | arm | tokens/s | ratio to baseline |")
    print("| --- | --- | ---: | ---: |")
    for length in args.prefill_lengths:
        label = f"prefill, prompt {length} x {args.prefill_requests}"
        print("\n".join(summarize(label, prefill[length], "primary only", arms)))
    for size in args.decode_batches:
        label = f"decode, batch {size}"
        print("\n".join(summarize(label, decode[size], "primary only", arms)))
        print("\n".join(summarize(f"decode only, batch {size}", decode_only[size], "primary only", arms)))
        limits = {arm: byte_limits(size, aux_top_k) for arm, aux_top_k in aux_arms.items()}
        for arm, limit in limits.items():
            print(
                f"| {label}, byte limit | {arm} | experts/layer/step: primary {limit['primary experts']:.1f}, "
                f"primary + aux {limit['primary + aux experts']:.1f} | {limit['byte limit']:.3f} |"
            )
        if args.quantised:
            print("\n".join(quantised_rows(size, decode, decode_only, limits["aux k_a=k_p"], served)))
        if not args.no_transformers:
            hf = decode[size]["transformers generate"]
            vs_hf = {"transformers generate": hf, "vLLM": decode[size]["aux k_a=k_p"]}
            label = f"decode, batch {size}, aux k_a=k_p"
            print("\n".join(summarize(label, vs_hf, "transformers generate", list(vs_hf))))
    for engine in engines.values():
        engine.llm_engine.engine_core.shutdown()
    gc.collect()


if __name__ == "__main__":
    main()
