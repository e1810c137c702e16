"""
`dualflow finetune --deepspeed CONFIG.json` under a launcher (torchrun, `accelerate launch`, `deepspeed`): the checks
of a DeepSpeed config before any work, DeepSpeed's checkpoints in Trainer's layout, and the one process of several
that owns the output folder.

Trainer saves a DeepSpeed checkpoint as `checkpoint-N/` with the usual files (the weights gathered, the tokenizer,
trainer_state.json, written last) plus DeepSpeed's own: `global_stepN/` (each rank's optimizer partition and, under
ZeRO-2, the module's states), `latest` (the name of that folder, written once every rank has saved its part) and
`zero_to_fp32.py`. Resuming reads `global_stepN/`, so such a checkpoint is complete only with both.
"""

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .errors import DualFlowUserError


T = TypeVar("T")
LATEST = "latest"  # DeepSpeed's file naming the checkpoint's global_step folder


def deepspeed_config(value) -> dict:
    """The DeepSpeed config of `--deepspeed` (a JSON file or a dict, as TrainingArguments takes it), or a one-line error."""
    if isinstance(value, dict):
        return value
    path = Path(value)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DualFlowUserError(f"--deepspeed {value}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DualFlowUserError(f"--deepspeed {value}: not a JSON file ({error})") from None
    if not isinstance(config, dict):
        raise DualFlowUserError(f"--deepspeed {value}: holds a JSON {type(config).__name__}, not an object")
    return config


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def world_size() -> int:
    """The processes of the launched run (torchrun and `accelerate launch` set WORLD_SIZE); 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def check_deepspeed_run(config: dict, load_in_4bit: bool) -> None:
    """One-line errors, before any work, for DeepSpeed runs that `dualflow finetune` cannot finish."""
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise DualFlowUserError(
            "--deepspeed needs a launcher: torchrun --nproc_per_node N, accelerate launch or deepspeed "
            "(one process: torchrun --nproc_per_node 1)"
        )
    stage = zero_stage(config)
    if load_in_4bit:
        raise DualFlowUserError("--load-in-4bit cannot train under DeepSpeed (ZeRO does not partition 4-bit weights)")
    gather = config.get("zero_optimization", {}).get("stage3_gather_16bit_weights_on_model_save")
    if stage == 3 and gather is not True:
        raise DualFlowUserError(
            '--deepspeed: a ZeRO-3 config needs "stage3_gather_16bit_weights_on_model_save": true in '
            '"zero_optimization", so that the checkpoints and the result are model folders'
        )
    check_optimizer_builds(config)


# The DeepSpeed op that each of DeepSpeed's own optimizers builds, with its states offloaded to the CPU and without
# (None: a torch optimizer). A name outside DeepSpeed's list is a torch.optim class (DeepSpeed's engine looks it up).
OPTIMIZER_OPS = {
    "adam": ("CPUAdamBuilder", "FusedAdamBuilder"),
    "adamw": ("CPUAdamBuilder", "FusedAdamBuilder"),
    "adagrad": ("CPUAdagradBuilder", None),
    "lamb": ("FusedLambBuilder", "FusedLambBuilder"),
    "lion": ("CPULionBuilder", "FusedLionBuilder"),
}
MUP_OPTIMIZERS = ("muadam", "muadamw", "musgd")


def check_optimizer_builds(config: dict) -> None:
    """A one-line error when the config's "optimizer" section names an optimizer this machine cannot build."""
    section = config.get("optimizer")
    if section is None:  # Trainer's own AdamW
        return
    if not isinstance(section, dict):
        raise DualFlowUserError(
            '--deepspeed: the "optimizer" section must be an object: {"type": NAME, "params": {...}}'
        )
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = str(section.get("type"))
    where = f'--deepspeed: the "optimizer" section names {name!r}'
    if name.lower() not in DEEPSPEED_OPTIMIZERS:
        if not isinstance(getattr(torch.optim, name, None), type):
            raise DualFlowUserError(
                f"{where}, neither one of DeepSpeed's ({', '.join(DEEPSPEED_OPTIMIZERS)}) nor a torch.optim class"
            )
        return
    name = name.lower()
    if name in MUP_OPTIMIZERS and importlib.util.find_spec("mup") is None:
        raise DualFlowUserError(f"{where}, which needs the mup package: pip install mup")
    offloaded = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    op = OPTIMIZER_OPS.get(name, (None, None))[0 if offloaded else 1]
    if name in ("adam", "adamw") and section.get("params", {}).get("torch_adam"):
        op = None
    accelerator = get_accelerator()
    builder = accelerator.get_op_builder(op) if op else None
    if op and (builder is None or builder.__name__ != op or not builder().is_compatible(verbose=False)):
        raise DualFlowUserError(
            f"{where}, whose DeepSpeed op ({op}) does not build on this machine's {accelerator.device_name()} "
            "accelerator: name another optimizer, or leave the section out for Trainer's AdamW"
        )


def check_model_partitions(config: dict, model_config) -> None:
    """A one-line error for a quantised checkpoint under ZeRO-3, which partitions every weight."""
    quantization = getattr(model_config, "quantization_config", None)
    if zero_stage(config) == 3 and quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
        raise DualFlowUserError(
            f"--deepspeed: the model is quantised ({method}) and ZeRO-3 partitions every weight, which quantised "
            "weights cannot be: fine-tune the unquantised checkpoint"
        )


def check_world_size(processes: int) -> None:
    """A one-line error when accelerate counted fewer processes than the launcher started."""
    if processes != world_size():
        raise DualFlowUserError(
            f"--deepspeed: the launcher started {world_size()} processes but accelerate counts {processes} (on a "
            "machine without GPUs accelerate runs DeepSpeed as one process per rank, each believing it is the only "
            "one): run DeepSpeed on GPUs"
        )


def start_processes(training_arguments: dict, output_dir) -> None:
    """
    Set up the launched processes as the run's Trainer will (TrainingArguments starts torch.distributed through
    accelerate), so that the processes can agree on the output folder before the model is loaded, and check that
    accelerate sees every process. The arguments object is dropped again: the model loads whole in each process (not
    partitioned while loading, which needs the TrainingArguments alive) and DeepSpeed partitions it when training
    starts.
    """
    from transformers import TrainingArguments

    from .finetune import LONGEST_SAVE_INTERVAL, TRAINER_DEFAULTS

    arguments = {**TRAINER_DEFAULTS, **training_arguments}
    if arguments["save_steps"] is None:  # make_trainer derives it from the data; any value sets the processes up
        arguments["save_steps"] = LONGEST_SAVE_INTERVAL
    arguments = TrainingArguments(output_dir=str(output_dir), **arguments)
    processes = arguments.world_size
    del arguments
    check_world_size(processes)


def from_main_process(decide: Callable[[], T]) -> T:
    """
    `decide()` run by the main process alone (it reads and cleans the output folder), its result handed to every
    process. Another process waits for it; if the main process fails, the launcher stops the others.
    """
    if world_size() == 1:
        return decide()
    import torch.distributed as dist

    result = [decide() if is_main_process() else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


@dataclass
class FollowerFolder:
    """The output folder as a process other than the main one sees it: it writes nothing but its checkpoint parts."""

    path: Path
    shown: Path
    resumed: bool = False

    def check_free_space(self, needed_bytes: int, what: str) -> None:
        """The main process checks."""


def global_step_folders(checkpoint: Path) -> list[Path]:
    return [path for path in checkpoint.glob("global_step*") if path.is_dir()]


def is_deepspeed_checkpoint(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds DeepSpeed's part of a checkpoint (complete or not)."""
    return (checkpoint / LATEST).exists() or bool(global_step_folders(checkpoint))


def deepspeed_checkpoint_complete(checkpoint: Path) -> bool:
    """Whether DeepSpeed's part of `checkpoint` was written in full: `latest` and the global_step folder it names."""
    try:
        tag = (checkpoint / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    folder = checkpoint / tag
    return bool(tag) and "/" not in tag and folder.is_dir() and any(folder.glob("*optim_states.pt"))


def optimizer_partitions(checkpoint: Path) -> int:
    """How many processes wrote the optimizer partitions of a complete DeepSpeed checkpoint."""
    tag = (checkpoint / LATEST).read_text().strip()
    return len(list((checkpoint / tag).glob("*optim_states.pt")))


def check_checkpoint_fits_run(checkpoint: Path, deepspeed: bool) -> None:
    """One-line errors for resuming a checkpoint that the run's mode cannot go on from."""
    if deepspeed and not is_deepspeed_checkpoint(checkpoint):
        raise DualFlowUserError(
            f"{checkpoint} was saved without DeepSpeed (no global_step folder): a --deepspeed run cannot resume its "
            "optimizer; start a new run from it as the model"
        )
    if not deepspeed and is_deepspeed_checkpoint(checkpoint):
        raise DualFlowUserError(
            f"{checkpoint} is a DeepSpeed checkpoint (its optimizer state is in {LATEST} / global_step*): resume it "
            "with the same --deepspeed config and number of processes"
        )
    if deepspeed and optimizer_partitions(checkpoint) != world_size():
        raise DualFlowUserError(
            f"{checkpoint} holds the optimizer of {optimizer_partitions(checkpoint)} processes, this run has "
            f"{world_size()}: resume it with as many processes"
        )


def deepspeed_checkpoint_bytes(saved: int, module: int, trainable_float32: int, stage: int) -> int:
    """
    Bytes of a DeepSpeed checkpoint: the `saved` weights (the model or adapter, gathered) that Trainer saves, the
    optimizer partitions in global_stepN/ (a float32 master copy and Adam's two moments of the trainable weights,
    `trainable_float32` bytes in float32, over all processes) and, under ZeRO-1 / 2, the module's states (all of its
    `module` bytes of weights once more).
    """
    return saved + (module if stage < 3 else 0) + 3 * trainable_float32
