"""Prefill on the base model, decode with Dual-Flow, through vLLM's ExampleConnector (issue 39).

    .venv-vllm/bin/python benchmarks/kv_transfer.py [--rounds 5 --batches 1 8 --prompt 258 --decode-tokens 64]

A random Qwen3-MoE (the CPU preset of vllm_throughput.py: hidden 512, 4 layers, 8 experts, k_p = 2), converted to
Dual-Flow with k_a = 2 k_p and its couplings perturbed, served by four engines at once (each in its engine process):
    base producer: vLLM's native Qwen3-MoE engine, `kv_producer` into one folder;
    Dual-Flow producer: the Dual-Flow engine, `kv_producer` into another;
    Dual-Flow consumer: the Dual-Flow engine, `kv_consumer` of the base producer's folder;
    Dual-Flow alone: the Dual-Flow engine, no connector.
Each round takes fresh random prompts per batch size (prefix caching off): both producers prefill them (1 generated
token; prompt tokens/s), then the consumer and the engine alone decode them (--decode-tokens each; generated tokens/s
from the step that gave every request its first token to the last token, vLLM's per-request timestamps, so neither
the consumer's KV load nor the engine's own prefill is in it). Orders rotate every round; medians and the median of
the per-round ratios with its standard error. KV bytes: what the connector stored per prompt token, by producer,
against the base model's K/V size (2 x layers x KV heads x head size x dtype bytes).

Every engine gets the same CPU cores for its OpenMP threads (`equal_cpu_binding`): vLLM's automatic binding on CPU
reserves one more core for an engine with a KV connector than for one without, and where the machine has too few cores
for that it reserves none, so on 2 cores the producers and the consumer ran 2 threads and the engine alone 1. The
consumer then decoded 1.3-1.5 times as fast as the engine alone on the same path (issue 63.4). vLLM's binding, not
OMP_NUM_THREADS, sets an engine's threads. The consumer must load what the base producer stored: the run fails where it
loaded nothing (vLLM's count of a request's cached prompt tokens, which takes in the connector's).
"""

import argparse
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from vllm_throughput import PRESETS, TOP_K, decode_only_seconds, model_fields, run_vllm, summarize

from dualflow.convert import convert_checkpoint
from dualflow.instruments.probes import rotated, seconds
from modeling_dualflow import DualFlowForCausalLM


# vLLM's CPU engines: the cores kept from the automatic OpenMP binding for the engine's other processes.
RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def equal_cpu_binding(environ) -> str:
    """
    Give every engine the same OpenMP cores: vLLM's automatic binding keeps one core per worker for the scheduler's
    process, and one more where a KV connector is configured (for the connector's transfers); with too few cores for
    that it keeps none, so an engine with a connector got more threads than one without. One reserved core for every
    engine, unless the caller chose a count, or named the cores (VLLM_CPU_OMP_THREADS_BIND, which binds every engine
    alike). Returns the binding, for the report.
    """
    environ.setdefault(RESERVED_CPUS, "1")
    cores = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return f"VLLM_CPU_OMP_THREADS_BIND={cores}, {RESERVED_CPUS}={environ[RESERVED_CPUS]}"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    # The ExampleConnector stores the whole blocks before a prompt's last token but looks up those before its last two:
    # a prompt of k blocks and 1 token (257 with vLLM's 128-token CPU blocks) stores k blocks the consumer never finds,
    # and the consumer computes the prompt itself. 258 moves two blocks, the consumer computes 2 tokens.
    parser.add_argument("--prompt", type=int, default=258, help="prompt tokens (the consumer loads the whole blocks)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile in vLLM")
    args = parser.parse_args()
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2: the decode rate counts the tokens after the first")
    return args


@torch.no_grad()
def save_checkpoints(folder: Path) -> tuple[Path, Path, Qwen3MoeConfig]:
    """The source model and its Dual-Flow conversion (k_a = 2 k_p), couplings perturbed as after fine-tuning."""
    preset = PRESETS["cpu"]
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        **model_fields(preset), head_dim=preset["hidden"] // preset["heads"], max_position_embeddings=4096
    )
    Qwen3MoeForCausalLM(config).save_pretrained(folder / "source")
    convert_checkpoint(folder / "source", folder / "converted", aux_top_k=2 * TOP_K, show_progress=False)
    model = DualFlowForCausalLM.from_pretrained(folder / "converted")
    for layer in model.model.layers:
        layer.aux_coupling.weight.normal_(std=0.1)
    model.save_pretrained(folder / "dualflow")
    return folder / "source", folder / "dualflow", config


def stored_kv(storage: Path) -> tuple[float, float]:
    """The connector's K/V tensor bytes per stored prompt token, and the tokens it stored per prompt (whole blocks)."""
    total_bytes, total_tokens = 0, 0
    for path in storage.glob("*/*.safetensors"):
        kv = load_file(path)["kv_cache"]
        total_bytes += kv.numel() * kv.element_size()
        total_tokens += len(kv) if path.name.startswith("model.layers.0.") else 0
    # a prompt shorter than a block and a token (the warm-up's) stores an empty file
    prompts = sum(len(load_file(path)["kv_cache"]) > 0 for path in storage.glob("*/model.layers.0.*"))
    return (total_bytes / total_tokens if total_tokens else float("nan")), total_tokens / prompts


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    binding = equal_cpu_binding(os.environ)  # before any engine starts: its processes read it
    from vllm import LLM

    with tempfile.TemporaryDirectory(prefix="dualflow-kv-bench-") as tmp:
        folder = Path(tmp)
        source, dualflow, config = save_checkpoints(folder)
        longest = args.prompt + args.decode_tokens + 16
        engine_args = dict(
            dtype="float32",
            max_model_len=longest,
            # a batch's prompts in one step: the producer stores what a request's first step computes
            max_num_batched_tokens=max(2048, max(args.batches) * args.prompt),
            disable_log_stats=False,  # per-request timestamps for the decode rate
            enable_prefix_caching=False,
            enforce_eager=args.enforce_eager,
            skip_tokenizer_init=True,
            seed=0,
        )

        def connector(role, storage):
            config = {"kv_connector": "ExampleConnector", "kv_role": role}
            return {"kv_transfer_config": config | {"kv_connector_extra_config": {"shared_storage_path": str(storage)}}}

        engines = {
            "base producer": LLM(model=str(source), **engine_args, **connector("kv_producer", folder / "kv-base")),
            "Dual-Flow producer": LLM(model=str(dualflow), **engine_args, **connector("kv_producer", folder / "kv-df")),
            "Dual-Flow consumer": LLM(
                model=str(dualflow), **engine_args, **connector("kv_consumer", folder / "kv-base")
            ),
            "Dual-Flow alone": LLM(model=str(dualflow), **engine_args),
        }
        producers, decoders = ["base producer", "Dual-Flow producer"], ["Dual-Flow alone", "Dual-Flow consumer"]
        generator = torch.Generator().manual_seed(1)

        warm_up = torch.randint(0, config.vocab_size, (1, 64), generator=generator).tolist()
        for name in producers + ["Dual-Flow alone"]:
            run_vllm(engines[name], warm_up, 4)
        run_vllm(engines["Dual-Flow consumer"], warm_up, 4)  # loads what the base producer stored for it

        prefill = {size: {name: [] for name in producers} for size in args.batches}
        decode = {size: {name: [] for name in decoders} for size in args.batches}
        same_tokens = True
        loaded = []  # prompt tokens of each consumer request that came from the connector
        for round_index in range(args.rounds):
            for size in args.batches:
                batch = torch.randint(0, config.vocab_size, (size, args.prompt), generator=generator).tolist()
                for name in rotated(producers, round_index):
                    prefill[size][name].append(size * args.prompt / seconds(run_vllm, engines[name], batch, 1))
                tokens = {}
                for name in rotated(decoders, round_index):
                    outputs = run_vllm(engines[name], batch, args.decode_tokens)
                    decode[size][name].append(size * (args.decode_tokens - 1) / decode_only_seconds(outputs))
                    tokens[name] = [list(output.outputs[0].token_ids) for output in outputs]
                    if name == "Dual-Flow consumer":
                        loaded += [output.num_cached_tokens for output in outputs]
                same_tokens &= tokens["Dual-Flow consumer"] == tokens["Dual-Flow alone"]
            print(f"round {round_index + 1}/{args.rounds} done", flush=True)
        block_size = engines["Dual-Flow consumer"].llm_engine.vllm_config.cache_config.block_size
        for engine in engines.values():
            engine.llm_engine.engine_core.shutdown()
        kv = {name: stored_kv(folder / f"kv-{key}") for name, key in (("base", "base"), ("Dual-Flow", "df"))}
        base_kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32

    print(
        f"\nQwen3-MoE hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_experts} experts, "
        f"k_p={TOP_K}, Dual-Flow k_a={2 * TOP_K}, float32; prompts of {args.prompt} tokens, {args.decode_tokens} "
        f"generated; {args.rounds} interleaved rounds, medians; CPU ({os.cpu_count()} cores; every engine: {binding})\n"
    )
    print("| measurement | engine | tokens/s | ratio to baseline |")
    print("| --- | --- | ---: | ---: |")
    for size in args.batches:
        print("\n".join(summarize(f"prefill, batch {size}", prefill[size], "base producer", producers)))
        print("\n".join(summarize(f"decode, batch {size}", decode[size], "Dual-Flow alone", decoders)))
    print(f"\nconsumer's greedy tokens equal the Dual-Flow engine's alone in every round: {same_tokens}")
    # the ExampleConnector moves whole blocks of the prompt but its last token; the consumer computes the rest
    print(f"KV blocks of {block_size} tokens; tokens stored per prompt: {kv['base'][1]:.0f} of {args.prompt}")
    print(f"KV bytes per prompt token stored: base {kv['base'][0]:,.0f}, Dual-Flow {kv['Dual-Flow'][0]:,.0f}; ", end="")
    print(f"the base model's K/V per token: {base_kv:,}")
    print(f"prompt tokens the consumer loaded per request: {min(loaded)} to {max(loaded)} of {args.prompt}")
    if min(loaded) == 0:
        raise SystemExit(
            "the consumer loaded no KV for some requests: it prefilled them itself, so it measured no P/D decode "
            f"(the ExampleConnector never finds a prompt of whole {block_size}-token blocks and 1 token, for one)"
        )


if __name__ == "__main__":
    main()
