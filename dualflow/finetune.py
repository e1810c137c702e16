"""
`dualflow finetune`: adapt a Dual-Flow checkpoint to a text corpus with `transformers.Trainer`.

Three modes: full fine-tuning, `--aux-only` (only the aux flow's own parameters: embedding, couplings and, where the
model has them, round gates and aux adapters; the primary flow stays the source model bit for bit) and `--lora` (PEFT
adapters on the shared weights plus the aux parameters, see `dualflow.lora`). The data (texts or chats, read with
`datasets`: `dualflow.training_data`) is tokenized with the model folder's tokenizer and packed into fixed-size
blocks. The command line is `dualflow.finetune_cli`.
"""

import errno
import importlib.util
import math
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator, set_seed

import modeling_dualflow  # noqa: F401  (registers the dualflow model type with the Auto classes)

from .aux_training import freeze_for_aux_training
from .checkpoint import WEIGHT_FILES, load_dualflow_config, load_dualflow_model, load_tokenizer
from .deepspeed_runs import (
    FollowerFolder,
    check_checkpoint_fits_run,
    check_deepspeed_run,
    check_model_partitions,
    deepspeed_checkpoint_bytes,
    deepspeed_checkpoint_complete,
    deepspeed_config,
    from_main_process,
    is_deepspeed_checkpoint,
    is_main_process,
    start_processes,
    world_size,
    zero_stage,
)
from .errors import DualFlowInterrupted, DualFlowUserError
from .lora import add_lora, qlora_quantization_config
from .model_card import license_of, write_adapter_card, write_model_card
from .output_folder import (
    UNFINISHED_MARKER,
    OutputFolder,
    cannot_write,
    file_system_error,
    foreign_entries,
    output_folder,
    remove,
    written_by_run,
)
from .quantisation_libraries import check_4bit_model_runs_on_this_cpu
from .scoring import mean_token_nlls
from .training_data import blocks_for_steps, load_data, pack_data


def split_blocks(blocks: torch.Tensor, eval_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Shuffle the blocks (along the first dimension: token blocks, or input ids and labels stacked) with `seed` and
    hold out `eval_fraction` of them (at least one) for evaluation.
    """
    if not 0 < eval_fraction < 1:
        raise DualFlowUserError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    num_eval = min(max(1, round(len(blocks) * eval_fraction)), len(blocks) - 1)
    return blocks[order[num_eval:]], blocks[order[:num_eval]]


def as_examples(blocks: torch.Tensor) -> list[dict]:
    """
    Causal-LM examples (the model shifts the labels itself) of token blocks (num_blocks, block_size), trained on every
    token, or of input ids and labels stacked (num_blocks, 2, block_size).
    """
    if blocks.dim() == 2:
        return [{"input_ids": block, "labels": block} for block in blocks]
    return [{"input_ids": input_ids, "labels": labels} for input_ids, labels in blocks]


# This package's choices where TrainingArguments' own defaults differ; any field can be overridden. Checkpoints are
# saved as Trainer saves them, so that a stopped run can be resumed; `save_steps` None: every tenth of the run, at
# most every 500 steps (Trainer's own interval), so that short runs save too; the newest two are kept.
TRAINER_DEFAULTS = {
    "learning_rate": 1e-4,
    "num_train_epochs": 1.0,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "seed": 0,
    "save_strategy": "steps",
    "save_steps": None,
    "save_total_limit": 2,
    "report_to": "none",
}
# Trainer's own interval between checkpoints, the most `save_steps` None waits.
LONGEST_SAVE_INTERVAL = 500
# The saved model's config in place of the training settings (finetune() sets the router logits the balance loss
# needs, Trainer turns the cache off): inference defaults, whatever the model started from. A Trainer checkpoint's
# config holds the training settings, so restoring the loaded values would save them again.
INFERENCE_SETTINGS = {"output_router_logits": False, "use_cache": True}


@dataclass(frozen=True)
class StepPlan:
    """
    A run's steps, derived once from its training arguments: `total` optimizer steps on one process (Trainer's count),
    a checkpoint every `save_interval` steps (with save_strategy "steps"; `save_steps` None: every tenth of the run,
    at most every LONGEST_SAVE_INTERVAL steps), at most `saves_kept` at once (None: all).
    """

    total: int
    save_strategy: str
    save_interval: int
    saves_kept: int | None
    num_train_epochs: float

    @classmethod
    def of(cls, num_blocks: int, arguments: dict) -> "StepPlan":
        """The plan of a run over `num_blocks` training blocks; `arguments`: TrainingArguments fields over TRAINER_DEFAULTS."""
        arguments = {**TRAINER_DEFAULTS, **arguments}
        if arguments.get("max_steps", -1) > 0:
            total = arguments["max_steps"]
        else:
            batches = math.ceil(num_blocks / arguments["per_device_train_batch_size"])
            total = math.ceil(batches / arguments.get("gradient_accumulation_steps", 1) * arguments["num_train_epochs"])
        save_steps = arguments["save_steps"]
        if save_steps is None:
            interval = min(LONGEST_SAVE_INTERVAL, math.ceil(total / 10))
        else:  # Trainer takes a number below 1 as a fraction of the run
            interval = math.ceil(total * save_steps) if save_steps < 1 else int(save_steps)
        return cls(
            total, arguments["save_strategy"], interval, arguments["save_total_limit"], arguments["num_train_epochs"]
        )

    def saves_to_go(self, start: int, kept: int) -> int:
        """The checkpoints a run resumed at step `start`, with `kept` complete checkpoints, has at once at most."""
        if self.save_strategy == "steps":
            saves = self.total // self.save_interval - start // self.save_interval
        else:  # "epoch" or "best": at most one a epoch
            saves = 0 if self.save_strategy == "no" else math.ceil(self.num_train_epochs)
        if self.saves_kept is not None:
            saves = min(saves, max(0, self.saves_kept + 1 - kept))
        return saves


def make_trainer(
    model,
    train_blocks: torch.Tensor,
    eval_blocks: torch.Tensor | None,
    output_dir,
    batch_size: int | None = None,
    tokenizer=None,
    plan: StepPlan | None = None,
    **training_arguments,
) -> Trainer:
    """
    A plain `transformers.Trainer` over packed blocks. `training_arguments` are `TrainingArguments` fields, on top of
    TRAINER_DEFAULTS; `batch_size` sets the train and eval batch per device. `tokenizer` is saved into every
    checkpoint (as Trainer saves its `processing_class`), so that a checkpoint is a model folder to fine-tune from.
    `plan`: the run's StepPlan, where the caller has it (the default checkpoint interval comes from it).
    """
    arguments = dict(TRAINER_DEFAULTS)
    if batch_size is not None:
        arguments.update(per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size)
    arguments.update(training_arguments)
    if getattr(model, "is_distributed_loading_by_transformers", False) and "save_only_model" not in training_arguments:
        # Trainer cannot checkpoint the optimizer of a model sharded at load (FSDP2 through `DistributedConfig`):
        # its checkpoints then hold the weights alone, and a stopped run starts again from them.
        arguments["save_only_model"] = True
    if arguments["save_steps"] is None:
        arguments["save_steps"] = (plan or StepPlan.of(len(train_blocks), arguments)).save_interval
    if not torch.cuda.is_available():
        arguments["dataloader_pin_memory"] = False  # nothing to pin for without a GPU (torch warns on every batch)
        if arguments.get("bf16"):
            arguments["use_cpu"] = True  # bf16 autocast runs on CPU, but Trainer allows it only when told so
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=str(output_dir), **arguments),
        train_dataset=as_examples(train_blocks),
        eval_dataset=as_examples(eval_blocks) if eval_blocks is not None else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,  # the blocks have one length: no padding (Trainer's choice for a tokenizer)
    )


class StopOnNonFiniteLoss(TrainerCallback):
    """
    Stops training at the end of the first optimizer step whose loss (the model's own, read from its forward outputs)
    or gradients were NaN or inf, and keeps Trainer from checkpointing that step; `diverged_at` is that step, None
    while everything was finite. (Trainer itself only leaves non-finite losses out of the loss it logs.) Gradients are
    not checked under --fp16, whose loss scaler skips steps with overflowing gradients by design.
    """

    def __init__(self):
        self.diverged_at = None
        self._step_finite = None  # whether this step's losses and gradients were finite: a tensor, read once per step
        self._hook = None

    def _record(self, finite: torch.Tensor):
        self._step_finite = finite if self._step_finite is None else self._step_finite & finite.to(self._step_finite)

    def _record_loss(self, module, inputs, outputs):
        loss = getattr(outputs, "loss", None)
        if module.training and loss is not None:
            self._record(torch.isfinite(loss.detach()).all())

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._hook = model.register_forward_hook(self._record_loss)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
        if gradients and not args.fp16:
            self._record(torch.nn.utils.get_total_norm(gradients, norm_type=math.inf).isfinite())

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_finite is not None and not self._step_finite.item():
            self.diverged_at = state.global_step
        self._step_finite = None
        if self.diverged_at is not None:
            control.should_training_stop = True
            control.should_save = False

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.diverged_at is not None:
            control.should_save = False

    def on_train_end(self, args, state, control, **kwargs):
        self._hook.remove()


def flow_nll(model, blocks: torch.Tensor, batch_size: int = 8, progress: bool = False) -> dict[str, float]:
    """
    Mean next-token NLL per token (nats) of each flow over `blocks`: {"aux flow": ..., "primary flow": ...};
    `progress` shows a progress bar over the batches.
    """
    was_training = model.training
    model.eval()
    totals = {"logits": 0.0, "primary_logits": 0.0}
    for start in tqdm(range(0, len(blocks), batch_size), desc="eval NLL", unit=" batches", disable=not progress):
        batch = blocks[start : start + batch_size]
        nll = mean_token_nlls(model, batch, tuple(totals), batch_size, use_aux_flow=True)
        for field in totals:  # every block has the same length: weighing by blocks weighs by tokens
            totals[field] += nll[field] * len(batch)
    model.train(was_training)
    return {"aux flow": totals["logits"] / len(blocks), "primary flow": totals["primary_logits"] / len(blocks)}


def _format_nll(nll: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.4f}" for name, value in nll.items())


@dataclass
class FinetuneResult:
    output_dir: Path
    eval_nll_before: dict[str, float] | None  # None: not measured (--eval-blocks 0)
    eval_nll_after: dict[str, float] | None
    trainable_parameters: int


def training_objective(config) -> str:
    """What Trainer's `train_loss` sums, in words: both flows' cross-entropies, so about twice the per-flow NLL."""
    weight = "" if config.primary_loss_weight == 1 else f"{config.primary_loss_weight:g} x "
    objective = f"aux-flow CE + {weight}primary-flow CE" if config.use_aux_flow else "primary-flow CE"
    if config.num_experts:
        objective += f" + {config.router_aux_loss_coef:g} x router balance loss"
    return objective


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("checkpoint-"))


def complete_checkpoints(folder: Path) -> list[Path]:
    """
    Trainer's checkpoints in `folder` that were saved in full (Trainer writes trainer_state.json last; a DeepSpeed
    checkpoint also needs its `latest` file and the global_step folder it names), by step.
    """
    found = [
        path
        for path in folder.glob("checkpoint-*")
        if path.name.removeprefix("checkpoint-").isdigit()
        and (path / "trainer_state.json").is_file()
        and (not is_deepspeed_checkpoint(path) or deepspeed_checkpoint_complete(path))
    ]
    return sorted(found, key=_step)


@dataclass
class RunState:
    """What the failure message of a run needs to know of it: the mode, and the disk it needs to go on."""

    lora: bool = False
    saves_checkpoints: bool = True
    bytes_to_go_on: Callable[[], int] | None = None  # disk the run writes when resumed from its last checkpoint


def _resume_advice(folder: OutputFolder, run: RunState, first_bad: int | None = None, full: bool = False) -> str:
    """
    Where the checkpoints are and how to go on: rerun the same command (it resumes from the last one; after a `full`
    disk, once enough space is free), or after training diverged at `first_bad` (the first step whose saved weights
    diverged), fine-tune the last checkpoint before it with a lower learning rate into another folder: resuming would
    restore the optimizer's and scheduler's learning rate, which diverged.
    """
    checkpoints = complete_checkpoints(folder.path)
    advice = f"checkpoints kept in {folder.shown} (last: {checkpoints[-1].name})"
    if first_bad is None:
        free_first = ""
        if full and run.bytes_to_go_on is not None:
            missing = run.bytes_to_go_on() - shutil.disk_usage(folder.path).free
            free_first = f"free at least {max(missing, 0) / 2**20:.1f} MiB on its disk, then " if missing > 0 else ""
        return f"{advice}; {free_first}rerun the same command to go on from the last one"
    if any(_step(checkpoint) >= first_bad for checkpoint in checkpoints):
        advice += f" (those from checkpoint-{first_bad} on hold the weights that diverged)"
    earlier = [checkpoint for checkpoint in checkpoints if _step(checkpoint) < first_bad]
    if earlier and not run.lora:  # a LoRA checkpoint holds the adapter alone: no model to start from
        return (
            f"{advice}; to go on, rerun the same command with {folder.shown / earlier[-1].name} as the model, a "
            "lower --learning-rate and another --output-dir"
        )
    return f"{advice}; rerun the same command with a lower --learning-rate and another --output-dir"


class TrainingDiverged(DualFlowUserError):
    """
    The training loss or the weights were NaN or inf at `step` (StopOnNonFiniteLoss stopped the run, or the check
    after the last step); `first_bad`: the first step whose checkpoint holds weights that diverged.
    """

    def __init__(self, step: int, weights: bool = False):
        what = "the weights after the last step were" if weights else "the loss or its gradients were"
        super().__init__(f"training diverged: {what} NaN or inf at step {step}; the model was not saved")
        # A non-finite loss at step N comes from the weights saved after step N - 1.
        self.first_bad = step if weights else step - 1


@contextmanager
def checkpoints_kept_on_failure(folder: OutputFolder, run: RunState):
    """
    Whatever ends the block early (an error, a full disk, Ctrl-C, SIGTERM, SIGHUP) leaves the complete checkpoints in
    OUT (`output_folder` removes the rest of what the run wrote) and says so in the one line the CLI prints: a
    DualFlowInterrupted for an interruption, a DualFlowUserError for the user's file system or mistake; another error
    (a bug) keeps its traceback after a line naming the checkpoints. An interruption of a run that saves no
    checkpoints says so.
    """
    try:
        yield
    except KeyboardInterrupt:
        if complete_checkpoints(folder.path):
            raise DualFlowInterrupted(_resume_advice(folder, run)) from None
        if not run.saves_checkpoints:
            raise DualFlowInterrupted(
                "no checkpoint was kept (--save-strategy no): pass --save-strategy steps --save-steps N to keep "
                "one every N steps"
            ) from None
        raise
    except Exception as error:
        write_error = file_system_error(error, folder.path)
        kept = bool(complete_checkpoints(folder.path))
        first_bad = error.first_bad if isinstance(error, TrainingDiverged) else None
        full = write_error is not None and write_error.errno in (errno.ENOSPC, errno.EDQUOT)
        advice = f"; {_resume_advice(folder, run, first_bad, full)}" if kept else ""
        if write_error is not None:
            raise DualFlowUserError(f"{cannot_write(folder.shown, write_error)}{advice}") from None
        if isinstance(error, DualFlowUserError):
            raise DualFlowUserError(f"{error}{advice}") from None
        if kept:
            print(f"dualflow finetune: {_resume_advice(folder, run)}", file=sys.stderr)
        raise


def _checkpoint_to_resume(folder: OutputFolder, resume, deepspeed: bool = False) -> Path | None:
    """
    The checkpoint to go on from: `--resume-from-checkpoint`'s, else the last complete one of the unfinished run in
    OUT (transformers' examples resume the same way). Checkpoints of two runs never share a folder: a checkpoint from
    elsewhere only starts a run in an empty OUT. A DeepSpeed checkpoint goes on only under `deepspeed` with as many
    processes, and another checkpoint only without.
    """
    found = complete_checkpoints(folder.path) if folder.resumed else []
    if resume is not None:
        print(f"resuming from {resume}")
    if resume is None:
        if found:
            print(f"resuming the unfinished run in {folder.shown} from its last checkpoint, {found[-1].name}")
            check_checkpoint_fits_run(found[-1], deepspeed)
            return found[-1]
        if folder.resumed:
            print(f"{folder.shown} holds an unfinished run with no complete checkpoint: starting over")
        return None
    resume = Path(resume)
    if (
        not (resume / "trainer_state.json").is_file()
        or not any((resume / name).is_file() for name in (*WEIGHT_FILES, "adapter_model.safetensors"))
        or (is_deepspeed_checkpoint(resume) and not deepspeed_checkpoint_complete(resume))
    ):
        raise DualFlowUserError(
            f"--resume-from-checkpoint {resume} is not a complete Trainer checkpoint folder (trainer_state.json and "
            "the weights)"
        )
    check_checkpoint_fits_run(resume, deepspeed)
    if found and Path(os.path.realpath(resume)).parent != folder.path:
        raise DualFlowUserError(
            f"{folder.shown} holds another unfinished run (last checkpoint {found[-1].name}): resuming from {resume} "
            "there would mix the checkpoints of two runs; choose another --output-dir"
        )
    return resume


def _resume_and_clean(folder: OutputFolder, resume, deepspeed: bool) -> Path | None:
    """The checkpoint to resume (`_checkpoint_to_resume`), once what an unfinished run left half written is removed."""
    resume = _checkpoint_to_resume(folder, resume, deepspeed)
    _remove_leftovers(folder)
    return resume


def _remove_leftovers(folder: OutputFolder) -> None:
    """
    Remove what an unfinished run wrote besides its complete checkpoints and marker (half-saved checkpoints and final
    files); what else is in OUT is the user's (notes, plots made from the kept checkpoints): it stays, and is named.
    """
    keep = complete_checkpoints(folder.path)
    for entry in folder.path.iterdir():
        if entry not in keep and entry.name != UNFINISHED_MARKER and written_by_run(entry, "finetune"):
            remove(entry)
    foreign = foreign_entries(folder.path, "finetune")
    if foreign:
        print(f"left as they are in {folder.shown}: {', '.join(entry.name for entry in foreign)}")


def _saved_bytes(model, lora: bool) -> tuple[int, int]:
    """
    Bytes of the saved weights and of one checkpoint (the weights and Adam's two moments of the trainable ones; under
    DeepSpeed, `deepspeed_checkpoint_bytes`). Under ZeRO-3 each parameter holds only its partition: counted whole.
    """
    from transformers.integrations.deepspeed import deepspeed_config as trainer_deepspeed_config

    parameters = list(model.parameters())
    numel = {id(p): getattr(p, "ds_numel", p.numel()) for p in parameters}
    trainable = sum(numel[id(p)] * p.element_size() for p in parameters if p.requires_grad)
    module = sum(numel[id(p)] * p.element_size() for p in parameters)
    weights = trainable if lora else module
    config = trainer_deepspeed_config()  # the running Trainer's DeepSpeed config, None without DeepSpeed
    if config is not None:
        trainable_float32 = 4 * sum(numel[id(p)] for p in parameters if p.requires_grad)
        return weights, deepspeed_checkpoint_bytes(weights, module, trainable_float32, zero_stage(config))
    return weights, weights + 2 * trainable


def _bytes_to_write(model, lora: bool, plan: StepPlan, folder: OutputFolder) -> int:
    """
    Disk a run writes at most from its last complete checkpoint on: the final weights and the checkpoints OUT holds
    at once (with `save_total_limit` L, Trainer saves a checkpoint before it removes the oldest: L + 1, counting those
    already there).
    """
    weights, checkpoint = _saved_bytes(model, lora)
    existing = complete_checkpoints(folder.path)
    if existing:  # a checkpoint also holds Trainer's state, the scheduler, the tokenizer: measure one
        checkpoint = max(checkpoint, sum(file.stat().st_size for file in existing[-1].rglob("*") if file.is_file()))
    start = _step(existing[-1]) if existing else 0
    return weights + plan.saves_to_go(start, len(existing)) * checkpoint


def _training_blocks(sources, tokenizer, config, model_path, block_size, blocks_needed, eval_fraction):
    """
    The train and eval blocks, (num_blocks, 2, block_size): each block's input ids and labels (-100 outside a chat's
    assistant turns); a DualFlowUserError when the tokenizer's ids do not fit the model's vocabulary.
    """
    input_ids, labels = pack_data(sources, tokenizer, block_size, blocks_needed, True)
    if int(input_ids.max()) >= config.vocab_size:
        raise DualFlowUserError(
            f"the tokenizer gives token id {int(input_ids.max())}, outside the model's vocabulary (vocab_size "
            f"{config.vocab_size}): the tokenizer in {model_path} does not belong to this model"
        )
    train_blocks, eval_blocks = split_blocks(torch.stack((input_ids, labels), dim=1), eval_fraction)
    print(f"data: {len(train_blocks)} train / {len(eval_blocks)} eval blocks of {block_size} tokens")
    return train_blocks, eval_blocks


def _model_to_train(source, config, compute_dtype, load_in_4bit, aux_only, lora_options, target_modules):
    """
    The model as it trains: loaded in float32 (in 4 bits with `load_in_4bit`), frozen but for the aux modules with
    `aux_only`, wrapped with LoRA given `lora_options` (`lora_r`, `lora_alpha`, `lora_dropout`).
    """
    quantization = {}
    if load_in_4bit:
        quantization["quantization_config"] = qlora_quantization_config(compute_dtype)
    model = load_dualflow_model(source, config=config, dtype=torch.float32, **quantization)
    if load_in_4bit:
        check_4bit_model_runs_on_this_cpu(model)
    if aux_only:
        freeze_for_aux_training(model)
    # A training setting, replaced by INFERENCE_SETTINGS before saving: the router balance loss is part of the
    # training objective (the model's loss adds it).
    model.config.output_router_logits = bool(model.config.num_experts)
    if lora_options is None:
        return model
    try:
        return add_lora(
            model,
            lora_options["lora_r"],
            lora_options["lora_alpha"],
            lora_dropout=lora_options["lora_dropout"],
            target_modules=target_modules,
        )
    except ValueError as error:  # PEFT: target modules the model does not have
        raise DualFlowUserError(f"--target-modules: {str(error).strip().splitlines()[0]}") from None


def _blocks_needed(streaming: bool, eval_fraction: float, training_arguments: dict) -> int | None:
    """How many blocks to read from a stream: those --max-steps trains on and the eval share; None: all the data."""
    arguments = {**TRAINER_DEFAULTS, **training_arguments}
    if not streaming or arguments.get("max_steps", -1) <= 0:
        return None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    batch = arguments["per_device_train_batch_size"] * arguments.get("gradient_accumulation_steps", 1) * world_size
    return blocks_for_steps(arguments["max_steps"], batch, eval_fraction)


def _check_numbers(block_size, lora, lora_r, lora_alpha, training_arguments):
    """One-line errors for numbers that torch, PEFT or Trainer would fail on with a traceback, or that train nothing."""
    arguments = {**TRAINER_DEFAULTS, **training_arguments}
    # `not value > 0` also refuses NaN.
    if block_size < 2:  # a block of one token has no next token to predict: the loss would be NaN
        raise DualFlowUserError(f"--block-size must be >= 2, got {block_size}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if arguments.get(name, 1) < 1:
            raise DualFlowUserError(f"--{name.replace('_', '-')} must be >= 1, got {arguments[name]}")
    if not arguments["learning_rate"] > 0:
        raise DualFlowUserError(f"--learning-rate must be > 0, got {arguments['learning_rate']}")
    if not arguments.get("warmup_steps", 0) >= 0:
        raise DualFlowUserError(f"--warmup-steps must be >= 0, got {arguments['warmup_steps']}")
    if arguments.get("max_steps", -1) <= 0 and not arguments["num_train_epochs"] > 0:
        raise DualFlowUserError(
            f"--num-train-epochs must be > 0 (or --max-steps given), got {arguments['num_train_epochs']}"
        )
    if lora and lora_r < 1:
        raise DualFlowUserError(f"--lora-r must be >= 1, got {lora_r}")
    if lora and not lora_alpha > 0:
        raise DualFlowUserError(f"--lora-alpha must be > 0, got {lora_alpha}")


def finetune(
    model_path,
    data_path,
    output_dir,
    lora: bool = False,
    load_in_4bit: bool = False,
    aux_only: bool = False,
    block_size: int = 512,
    eval_fraction: float = 0.1,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
    text_field: str = "text",
    data_split: str = "train",
    data_config: str | None = None,
    streaming: bool = False,
    eval_blocks_max: int | None = None,
    data_name: str | None = None,
    **training_arguments,
) -> FinetuneResult:
    """
    Fine-tune `model_path` on `data_path` and save the result into `output_dir`: the full model (loadable with
    `AutoModelForCausalLM`, also as remote code) or, with `lora`, the adapter (load it with `peft.PeftModel.from_pretrained`);
    `load_in_4bit` (with `lora`): QLoRA, the adapter trained on the model loaded in 4 bits
    (`qlora_quantization_config`).
    `training_arguments` go to `make_trainer` (`resume_from_checkpoint` to `Trainer.train`). Trainer writes its
    checkpoints into `output_dir` as `checkpoint-N`; a run stopped early (Ctrl-C, an error) keeps the complete ones
    there, and calling again with the same `output_dir` goes on from the last one. `data_path`, `text_field`,
    `data_split`, `data_config`, `streaming`: the data, as `dualflow.training_data.load_data` reads it. `data_name`:
    how the model card names the training data (local file names are not published).
    """
    if lora and aux_only:
        raise DualFlowUserError("--lora and --aux-only are exclusive (LoRA already trains the aux parameters in full)")
    if load_in_4bit and not lora:
        raise DualFlowUserError(
            "--load-in-4bit needs --lora (QLoRA): a full or --aux-only run saves the whole model, "
            "4-bit weights included"
        )
    if load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise DualFlowUserError("--load-in-4bit needs bitsandbytes: pip install bitsandbytes")
    _check_numbers(block_size, lora, lora_r, lora_alpha, training_arguments)
    if eval_blocks_max is not None and eval_blocks_max < 0:
        raise DualFlowUserError(f"--eval-blocks must be >= 0 (0: no NLL before / after), got {eval_blocks_max}")
    if lora and not 0 <= lora_dropout < 1:
        raise DualFlowUserError(f"--lora-dropout must be in [0, 1), got {lora_dropout}")
    resume = training_arguments.pop("resume_from_checkpoint", None)
    deepspeed = training_arguments.get("deepspeed")
    zero_config = deepspeed_config(deepspeed) if deepspeed else None
    if zero_config is not None:
        check_deepspeed_run(zero_config, load_in_4bit)
    if world_size() > 1:  # launched processes agree on OUT before any work (their process group)
        start_processes(training_arguments, output_dir)
    sources = load_data(data_path, text_field, data_split, data_config, streaming)
    config = load_dualflow_config(model_path)
    if zero_config is not None:
        check_model_partitions(zero_config, config)
    tokenizer = load_tokenizer(model_path)
    block_size = min(block_size, config.max_position_embeddings)
    # OUT is made and locked at once: an output that cannot be written fails before tokenizing and training.
    # With several processes the main one owns OUT (lock, marker, cleanup); the others write their checkpoint parts.
    owned = output_folder(output_dir, "finetune", resume=True, keep=complete_checkpoints)
    if not is_main_process():
        owned = nullcontext(FollowerFolder(Path(os.path.realpath(output_dir)), Path(output_dir)))
    with owned as folder:
        run = RunState(lora=lora, saves_checkpoints=training_arguments.get("save_strategy", "steps") != "no")
        with checkpoints_kept_on_failure(folder, run):
            resume = from_main_process(lambda: _resume_and_clean(folder, resume, bool(deepspeed)))
            blocks_needed = _blocks_needed(streaming, eval_fraction, training_arguments)
            train_blocks, eval_blocks = _training_blocks(
                sources, tokenizer, config, model_path, block_size, blocks_needed, eval_fraction
            )
            # The blocks the NLL before / after training is measured on, at every token.
            measured = eval_blocks[:eval_blocks_max, 0]
            if not len(measured):
                print("eval NLL before / after: not measured (--eval-blocks 0)")
            elif len(measured) < len(eval_blocks):
                print(f"eval NLL before / after measured on {len(measured)} of the {len(eval_blocks)} eval blocks")
            # An absolute path, so that a saved adapter's `base_model_name_or_path` loads from any directory.
            source = Path(model_path).resolve() if Path(model_path).is_dir() else model_path
            compute_dtype = torch.bfloat16 if training_arguments.get("bf16") else torch.float32
            lora_options = dict(lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout) if lora else None
            # Seeded as Trainer seeds: the new LoRA weights are the same in every run of the command and every process
            set_seed(training_arguments.get("seed", TRAINER_DEFAULTS["seed"]))
            model = _model_to_train(source, config, compute_dtype, load_in_4bit, aux_only, lora_options, target_modules)
            trainable = model.num_parameters(only_trainable=True)
            print(f"trainable parameters: {trainable:,}")

            plan = StepPlan.of(len(train_blocks), training_arguments)
            trainer = make_trainer(
                model, train_blocks, eval_blocks, folder.path, tokenizer=tokenizer, plan=plan, **training_arguments
            )
            run.bytes_to_go_on = lambda: _bytes_to_write(model, lora, plan, folder)
            folder.check_free_space(run.bytes_to_go_on(), "this run")
            eval_batch = trainer.args.per_device_eval_batch_size
            before = after = None
            if len(measured):
                before = flow_nll(trainer.model, measured, eval_batch, progress=True)
                of_what = f" (the model {model_path}, before step 1)" if resume is not None else ""
                print(f"eval NLL per token (nats) before{of_what}: {_format_nll(before)}")
            print(f"train_loss (Trainer's) = {training_objective(config)}; the eval NLL is per flow")
            divergence = StopOnNonFiniteLoss()
            trainer.add_callback(divergence)
            if resume is not None and _step(resume) >= plan.total:
                # The run was stopped after its last step: Trainer, resumed there, would make one step more.
                print(f"{resume.name} is the run's last step ({plan.total}): its weights are the result")
                trainer._load_from_checkpoint(str(resume))
            else:
                trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
            if divergence.diverged_at is not None:
                raise TrainingDiverged(divergence.diverged_at)
            # Under DeepSpeed the weights gathered from every process (the main one gets them; ZeRO-3 holds partitions)
            weights = trainer.accelerator.get_state_dict(trainer.deepspeed) if trainer.deepspeed is not None else None
            if not all(parameter.isfinite().all() for parameter in (weights or {}).values() or model.parameters()):
                raise TrainingDiverged(trainer.state.global_step, weights=True)
            if len(measured):
                # Measured as "before" was, in float32: training left `--bf16`'s autocast wrapped around the forward.
                after = flow_nll(
                    trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False),
                    measured,
                    eval_batch,
                    progress=True,
                )
                print(f"eval NLL per token (nats) after:  {_format_nll(after)}")

            for name, value in INFERENCE_SETTINGS.items():
                setattr(model.config, name, value)
            if not is_main_process():
                return FinetuneResult(output_dir, before, after, trainable)
            model.save_pretrained(folder.path, state_dict=weights)
            mode = "LoRA" if lora else "aux-only" if aux_only else "full"
            training = f"Fine-tuned ({mode}) with `dualflow finetune` on {data_name or 'local text data'}"
            if before is not None:
                training += f": eval NLL per token (nats) before: {_format_nll(before)}; after: {_format_nll(after)}"
            training += "."

            # The card names OUT as the user named it (a symbolic link, not its target).
            repo_id = Path(os.path.abspath(folder.shown)).name
            if lora:
                write_adapter_card(folder.path, config, str(source), repo_id=repo_id, extra=training)
            else:
                write_model_card(
                    folder.path, model.config, repo_id=repo_id, license=license_of(model_path), extra=training
                )
            tokenizer.save_pretrained(folder.path)
    print(f"saved {'adapter' if lora else 'model'} to {output_dir}")
    return FinetuneResult(output_dir, before, after, trainable)
