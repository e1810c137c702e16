"""
Train a saved Dual-Flow checkpoint for a few steps with `transformers.Trainer` and write the losses to a JSON file.

Launched by tests/test_distributed.py as

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/train_fsdp.py MODEL_DIR OUT.json --fsdp

(FSDP2 through Trainer/accelerate; gloo on CPU), and run as one process for the reference. The global batch is the same
either way: each of N processes takes `global_batch // N` rows of it. Before training, every parameter's gradient on
the first global batch goes to gradients.pt beside OUT.json (gathered whole from the FSDP shards).
"""

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import ByT5Tokenizer
from transformers.distributed import DistributedConfig

from dualflow.finetune import make_trainer, split_blocks
from dualflow.training_data import DataSource, pack_data
from modeling_dualflow import DualFlowForCausalLM


BLOCK_SIZE = 32


def stdlib_blocks():
    """Byte-level blocks of a Python stdlib source file: real text that needs no download."""
    text = Path(inspect.__file__).read_text(encoding="utf-8")[:20_000]
    return pack_data([DataSource.of_texts([text])], ByT5Tokenizer(), BLOCK_SIZE)[0]


def sharded_fraction(model) -> float:
    """Share of this process's parameter elements that it holds locally (1.0 when nothing is sharded)."""
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return local / sum(p.numel() for p in model.parameters())


def fsdp_units(model) -> list[str]:
    """Names of the modules FSDP2 gathers and frees as one unit."""
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def gradients(model, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """
    Every parameter's whole gradient of the mean loss over `rows`, each process taking its share of the rows (FSDP2
    averages the shares' gradients); the model is left without gradients.
    """
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    share = rows.shape[0] // world_size
    local = rows[rank * share : (rank + 1) * share]
    model.train()
    model(local, labels=local).loss.backward()
    result = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return result


def train(model_dir, output_dir, steps: int, global_batch: int, fsdp: bool) -> tuple[dict, dict]:
    """
    Losses of `steps` optimizer steps on `global_batch` rows per step and the eval loss afterwards, and the gradients
    of the first global batch before them.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    train_blocks, eval_blocks = split_blocks(stdlib_blocks(), eval_fraction=0.1)
    # transformers' own FSDP2 (the config's `base_model_fsdp_plan`): accelerate's FSDP plugin needs GPUs.
    distributed_config = DistributedConfig(fsdp_size=world_size) if fsdp else None
    model = DualFlowForCausalLM.from_pretrained(model_dir, distributed_config=distributed_config)
    first_gradients = gradients(model, train_blocks[:global_batch])
    trainer = make_trainer(
        model,
        train_blocks,
        eval_blocks[:4],
        output_dir,
        batch_size=global_batch // world_size,
        max_steps=steps,
        learning_rate=3e-3,
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer.train()
    train_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "world_size": world_size,
        "sharded": sharded_fraction(model),
        "fsdp_units": fsdp_units(model),
        "train_losses": train_losses,
        "eval_loss": trainer.evaluate()["eval_loss"],
    }, first_gradients


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("model_dir")
    parser.add_argument("output_json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    output_dir = Path(args.output_json).parent / "trainer"
    result, first_gradients = train(args.model_dir, output_dir, args.steps, args.global_batch, args.fsdp)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.output_json).write_text(json.dumps(result))
        torch.save(first_gradients, Path(args.output_json).parent / "gradients.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: once in CI (transformers 5.19) a process aborted there after all of the
    # above ("terminate called without an active exception", a native thread destroyed at exit), failing the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
