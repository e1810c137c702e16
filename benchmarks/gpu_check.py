"""One-command GPU check of a random Mixtral-shaped Dual-Flow model in bf16: one JSON + a short table.

    python benchmarks/gpu_check.py [--out docs/results/gpu.json]     # about 5 minutes on one H200
    python benchmarks/gpu_check.py --quick --out /tmp/gpu_check.json  # the same code, tiny model, CPU, seconds

Sections (each one runs on its own: an error is recorded in the JSON under that section and the others still run):
environment (versions, device, experts kernel in use); parity (aux off vs the source Mixtral, and aux on at the
upcycling init, k_a == k_p); prefill dual / primary; decode dual / primary at batch 1 and 16 with a dynamic cache and
with generate's compiled static cache, next to the byte limit computed from the routes both flows actually took;
training per attention backend (sdpa, flex_attention, flash_attention_2 if importable): step time, peak memory, the
loss and the weights its backward leaves without a gradient.
Times are CUDA-synchronised wall clock, variants interleaved, medians. Results go to docs/results/gpu.md.
After the table it prints the number to meet for decode aux on / off (benchmarks/decode_roofline.py's byte model for a
Qwen3-30B-A3B shape at an H100's bandwidth; docs/results/gpu.md, "The number to meet").
"""

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout: no install needed

from convert.families import family_for  # noqa: E402
from dualflow.convert import init_aux_from_primary  # noqa: E402
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_roofline import gpu_prediction_table  # noqa: E402


FULL = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    prefill_lengths=[2048, 8192],
    decode_context=512,
    decode_tokens=32,
    train_length=2048,
    repeats=5,
)
QUICK = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
    prefill_lengths=[16, 32],
    decode_context=8,
    decode_tokens=2,
    train_length=16,
    repeats=1,
)
MODEL_FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_local_experts",
    "num_experts_per_tok",
    "vocab_size",
]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_medians(variants: dict, device, repeats: int) -> dict:
    """Median seconds per variant; one warm-up each, then the variants alternate, order rotated every round."""
    for fn in variants.values():
        fn()
    samples = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            samples[name].append(seconds(variants[name], device))
    return {name: statistics.median(values) for name, values in samples.items()}


def build_models(shape: dict, device, dtype):
    """A random Mixtral and the Dual-Flow model converted from it in memory (upcycling init: aux == primary)."""
    torch.manual_seed(0)
    source_config = MixtralConfig(
        **{field: shape[field] for field in MODEL_FIELDS}, max_position_embeddings=16384, dtype=dtype
    )
    with torch.device(device):
        source = MixtralForCausalLM(source_config).to(dtype).eval()
    config = DualFlowConfig(**family_for("mixtral").dualflow_config_fields(source_config))
    with torch.device(device):
        model = DualFlowForCausalLM(config).to(dtype).eval()
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    if unexpected or any(not any(part.startswith("aux_") for part in name.split(".")) for name in missing):
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    init_aux_from_primary(model)
    return source, model


def environment(model, device) -> dict:
    try:
        import flash_attn  # noqa: F401

        flash = True
    except ImportError:
        flash = False
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
        "flash_attn_importable": flash,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


@torch.inference_mode()
def parity(source, model, shape, device) -> dict:
    ids = torch.randint(0, shape["vocab_size"], (2, 256 if device.type == "cuda" else 8), device=device)
    expected = source(ids).logits.float()
    primary = model(ids, use_aux_flow=False).logits.float()
    dual = model(ids).logits.float()
    generate = dict(max_new_tokens=16 if device.type == "cuda" else 2, do_sample=False, pad_token_id=0)
    return {
        "aux_off_max_abs_diff": (primary - expected).abs().max().item(),
        "aux_on_max_abs_diff": (dual - expected).abs().max().item(),
        "logit_scale": expected.abs().max().item(),
        "greedy_tokens_equal": bool(torch.equal(source.generate(ids, **generate), model.generate(ids, **generate))),
    }


@torch.inference_mode()
def prefill(model, shape, device) -> dict:
    result = {}
    for length in shape["prefill_lengths"]:
        prompt = torch.randint(0, shape["vocab_size"], (1, length), device=device)
        times = interleaved_medians(
            {
                "primary": lambda prompt=prompt: model(prompt, logits_to_keep=1, use_aux_flow=False),
                "dual": lambda prompt=prompt: model(prompt, logits_to_keep=1),
            },
            device,
            shape["repeats"],
        )
        result[str(length)] = {**times, "ratio": times["dual"] / times["primary"]}
    return result


@torch.inference_mode()
def byte_limit(model, tokens, shape) -> dict:
    """
    The decode step's lower bound in bytes: every non-expert weight once, the experts either flow routes to (per layer)
    and the KV cache once. The ratio dual / primary is the most a bandwidth-bound step may cost extra.
    """
    context = model(tokens[:, :-1], use_cache=True, logits_to_keep=1, use_aux_flow=False).past_key_values
    # (`past_key_values`: the output field on every transformers in range; 5.24 names it `cache` too)
    out = model(tokens[:, -1:], past_key_values=context, output_router_logits=True)
    top_p, top_a = model.config.num_experts_per_tok, model.config.aux_num_experts_per_tok
    expert_bytes = 0
    for name, parameter in model.named_parameters():
        if ".mlp.experts." in name:
            expert_bytes += parameter[0].numel() * parameter.element_size()  # one expert's slice
    expert_bytes //= model.config.num_hidden_layers
    non_expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." not in n)
    non_expert -= model.model.aux_embed_tokens.weight.nbytes  # an embedding lookup reads rows, not the table
    non_expert -= model.model.embed_tokens.weight.nbytes * (not model.config.tie_word_embeddings)
    kv = context.nbytes() if hasattr(context, "nbytes") else 0
    used_primary = used_dual = 0
    for primary_logits, aux_logits in zip(out.router_logits, out.aux_router_logits):
        primary_experts = set(primary_logits.topk(top_p, dim=-1).indices.flatten().tolist())
        used_primary += len(primary_experts)
        used_dual += len(primary_experts | set(aux_logits.topk(top_a, dim=-1).indices.flatten().tolist()))
    primary_bytes = non_expert + used_primary * expert_bytes + kv
    dual_bytes = non_expert + used_dual * expert_bytes + kv
    return {"primary_bytes": primary_bytes, "dual_bytes": dual_bytes, "ratio": dual_bytes / primary_bytes}


@torch.inference_mode()
def decode(model, shape, device) -> dict:
    result = {}
    steps = shape["decode_tokens"]
    for batch in (1, 16):
        prompt = torch.randint(0, shape["vocab_size"], (batch, shape["decode_context"]), device=device)
        entry = {"byte_limit": byte_limit(model, prompt, shape)}
        for cache in ("dynamic", "static"):  # generate compiles the static-cache decode step on a GPU

            def run(use_aux_flow, tokens, cache=cache, prompt=prompt):
                options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
                return model.generate(prompt, use_aux_flow=use_aux_flow, cache_implementation=cache, **options)

            # per decode step: generate(steps + 1 tokens) - generate(1 token), so the prefill drops out
            times = interleaved_medians(
                {
                    f"{flow}_{tokens}": lambda flow=flow, tokens=tokens: run(flow == "dual", tokens)
                    for flow in ("primary", "dual")
                    for tokens in (1, steps + 1)
                },
                device,
                shape["repeats"],
            )
            per_token = {
                flow: (times[f"{flow}_{steps + 1}"] - times[f"{flow}_1"]) / steps for flow in ("primary", "dual")
            }
            entry[cache] = {**per_token, "ratio": per_token["dual"] / per_token["primary"]}
        result[str(batch)] = entry
    return result


def training(model, shape, device) -> dict:
    backends = ["sdpa"]
    if device.type == "cuda":  # inductor's flex kernels take minutes to compile on a CPU
        backends.append("flex_attention")
    if environment(model, device)["flash_attn_importable"] and device.type == "cuda":
        backends.append("flash_attention_2")
    ids = torch.randint(0, shape["vocab_size"], (1, shape["train_length"]), device=device)
    result = {}
    model.train()
    try:
        for backend in backends:
            try:
                model.set_attn_implementation(backend)

                def step():
                    model.zero_grad(set_to_none=True)
                    model(ids, labels=ids).loss.backward()

                step_seconds = interleaved_medians({"step": step}, device, shape["repeats"])["step"]
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                loss = model(ids, labels=ids).loss
                loss.backward()
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                result[backend] = {
                    "step_seconds": step_seconds,
                    "peak_bytes": peak,
                    "loss": loss.item(),
                    # a backend whose backward drops a path leaves weights without a gradient
                    "parameters_without_grad": [n for n, p in model.named_parameters() if p.grad is None],
                }
            except Exception as error:  # one backend failing must not hide the others
                result[backend] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
        model.set_attn_implementation("sdpa")
    return result


def table(results: dict) -> str:
    lines = []
    for length, row in (results.get("prefill") or {}).items():
        if isinstance(row, dict) and "ratio" in row:
            lines.append(f"prefill {length:>5} tokens   dual/primary {row['ratio']:.3f}")
    for batch, entry in (results.get("decode") or {}).items():
        if not isinstance(entry, dict) or "byte_limit" not in entry:
            continue
        for cache in ("dynamic", "static"):
            row = entry.get(cache, {})
            if "ratio" in row:
                lines.append(
                    f"decode batch {batch:>2} {cache:>7}  dual/primary {row['ratio']:.3f}  "
                    f"(byte limit {entry['byte_limit']['ratio']:.3f}; primary {row['primary'] * 1e3:.2f} ms/token)"
                )
    for backend, row in (results.get("training") or {}).items():
        if isinstance(row, dict) and "step_seconds" in row:
            memory = f", peak {row['peak_bytes'] / 2**30:.1f} GiB" if row["peak_bytes"] else ""
            lines.append(f"training step {backend:>17}  {row['step_seconds']:.3f} s{memory}")
    errors = [name for name, value in results.items() if isinstance(value, dict) and "error" in value]
    if errors:
        lines.append(f"sections that failed (see the JSON): {', '.join(errors)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script, no numbers")
    parser.add_argument("--out", type=Path, default=Path("docs/results/gpu.json"))
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {"model": {field: shape[field] for field in MODEL_FIELDS}, "dtype": str(dtype), "quick": args.quick}
    source, model = build_models(shape, device, dtype)
    sections = {
        "environment": lambda: environment(model, device),
        "parity": lambda: parity(source, model, shape, device),
        "prefill": lambda: prefill(model, shape, device),
        "decode": lambda: decode(model, shape, device),
        "training": lambda: training(model, shape, device),
    }
    for name, section in sections.items():
        start = time.perf_counter()
        try:
            results[name] = section()
        except Exception as error:  # record it and go on: one failing section must not lose the others
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
        if name == "parity":
            source = None  # its memory goes back before the timed sections
            if device.type == "cuda":
                torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # after every section: a crash keeps the rest
    print(table(results))
    print(f"\nthe number to meet (bandwidth-bound decode, docs/results/gpu.md):\n{gpu_prediction_table()}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
