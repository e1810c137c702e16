"""Quantised Dual-Flow side by side with its Qwen3-MoE source: weight footprints, and QLoRA's peak memory.

    OMP_NUM_THREADS=1 python benchmarks/quantisation.py [--rounds 3 --steps 3]

A Qwen3-MoE built from a config with transformers' class (random weights; the default: hidden 256, 4 layers of 8
experts, vocab 8000) and its `dualflow convert` conversion, loaded in bfloat16 and under bitsandbytes 4-bit (NF4) and
8-bit and torchao int8 weight-only (the nn.Linear layers; a second torchao row names the fused experts too). The
footprint is the bytes of every weight and buffer as stored (a torchao tensor by its int8 data and scales): the same
in every run, so measured once.

QLoRA against bf16 LoRA: `dualflow.lora.add_lora` on the Dual-Flow model loaded in bfloat16 or in 4 bits (QLoRA
computing in bfloat16, as `dualflow finetune --load-in-4bit --bf16` does), then `--steps` AdamW steps of
forward + backward on a batch of 4 x 128 tokens. Each run is a fresh process; its peak memory is the process's peak
RSS from loading to the last step (Linux VmHWM, reset via /proc/self/clear_refs) above the RSS before loading: the
weights, LoRA's optimizer state and the activations. The two setups alternate over `--rounds` rounds; medians and
standard errors.
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM, TorchAoConfig

from dualflow.convert import convert_checkpoint
from dualflow.instruments.probes import peak_memory_bytes, peak_memory_method, stored_bytes
from dualflow.lora import add_lora, qlora_quantization_config


EXPERT_WEIGHTS = r"re:.*\.mlp\.experts\.(gate_up_proj|down_proj)"
QUANTISATIONS = {
    "bfloat16": lambda: None,
    "bitsandbytes 4-bit (NF4)": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bitsandbytes 8-bit": lambda: BitsAndBytesConfig(load_in_8bit=True),
    "torchao int8 weight-only": lambda: TorchAoConfig(Int8WeightOnlyConfig()),
    "torchao int8, fused experts too": lambda: TorchAoConfig(
        FqnToConfig({EXPERT_WEIGHTS: Int8WeightOnlyConfig(), r"re:.*\.(q|k|v|o)_proj": Int8WeightOnlyConfig()})
    ),
}
SETUPS = ["bf16 LoRA", "QLoRA (4-bit)"]


def source_config(args) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )


def footprints(folders: dict[str, Path]) -> dict[str, dict[str, int]]:
    table = {}
    for name, make_config in QUANTISATIONS.items():
        table[name] = {}
        for model_name, folder in folders.items():
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.bfloat16, quantization_config=make_config(), trust_remote_code=True
            )
            table[name][model_name] = stored_bytes(model)
    return table


def train_run(folder: Path, setup: str, steps: int) -> int:
    """One setup's training in this process: its peak RSS above what the process held before loading, in bytes."""
    generator = torch.Generator().manual_seed(0)

    def train():
        kwargs = {"quantization_config": qlora_quantization_config(torch.bfloat16)} if "QLoRA" in setup else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)
        model = add_lora(model, r=16, lora_alpha=32)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        for _ in range(steps):
            batch = torch.randint(0, model.config.vocab_size, (4, 128), generator=generator)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    _, above_before = peak_memory_bytes(train, torch.device("cpu"))
    return above_before


def median_and_error(values: list[float]) -> str:
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{statistics.median(values) / 2**20:.1f} ± {error / 2**20:.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--train-run", nargs=2, metavar=("FOLDER", "SETUP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_run:
        print(json.dumps({"peak": train_run(Path(args.train_run[0]), args.train_run[1], args.steps)}))
        return

    with tempfile.TemporaryDirectory() as scratch:
        folders = {"Qwen3-MoE": Path(scratch) / "qwen3-moe", "Dual-Flow": Path(scratch) / "dualflow"}
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(source_config(args)).save_pretrained(folders["Qwen3-MoE"])
        convert_checkpoint(folders["Qwen3-MoE"], folders["Dual-Flow"], show_progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchao's note that FqnToConfig's regex keys are new
            table = footprints(folders)
        print("| weights | Qwen3-MoE | Dual-Flow | Dual-Flow - Qwen3-MoE |\n|---|---|---|---|")
        for name, sizes in table.items():
            qwen, dualflow = sizes["Qwen3-MoE"], sizes["Dual-Flow"]
            print(
                f"| {name} | {qwen / 2**20:.2f} MiB | {dualflow / 2**20:.2f} MiB | {(dualflow - qwen) / 2**20:.2f} MiB |"
            )

        peaks = {setup: [] for setup in SETUPS}
        for round_index in range(args.rounds):
            order = SETUPS if round_index % 2 == 0 else SETUPS[::-1]
            for setup in order:
                command = [sys.executable, __file__, "--train-run", str(folders["Dual-Flow"]), setup]
                command += ["--steps", str(args.steps)]
                completed = subprocess.run(command, capture_output=True, text=True, check=True)
                peaks[setup].append(json.loads(completed.stdout.strip().splitlines()[-1])["peak"])
        print(f"\nPeak memory, {peak_memory_method(torch.device('cpu'))}; {args.rounds} rounds, {args.steps} steps:")
        for setup, values in peaks.items():
            print(f"- {setup}: {median_and_error(values)}")


if __name__ == "__main__":
    main()
