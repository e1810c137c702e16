"""
`dualflow finetune`: adapt a Dual-Flow checkpoint to a text corpus with `transformers.Trainer`.

Three modes: full fine-tuning, `--aux-only` (only the aux flow's own parameters: embedding, couplings and, where the
model has them, round gates; the primary flow stays the source model bit for bit) and `--lora` (PEFT adapters on the
shared weights plus the aux parameters, see `dualflow.lora`). The data is a .txt file (one document) or a .jsonl file (one {"text": ...} document per line),
tokenized with the model folder's tokenizer and packed into fixed-size blocks.
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from .checkpoint import load_dualflow_config
from .errors import DualFlowUserError
from .lora import add_lora
from .model_card import license_of, write_model_card


def read_texts(path) -> list[str]:
    """Documents of a .txt file (the whole file) or a .jsonl file (the "text" field of every non-blank line)."""
    path = Path(path)
    if not path.is_file():
        raise DualFlowUserError(f"data file {path} does not exist")
    if path.suffix not in (".txt", ".jsonl"):
        raise DualFlowUserError(
            f'data file {path} must end in .txt (plain text) or .jsonl (one {{"text": ...}} per line)'
        )
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DualFlowUserError(f"data file {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if path.suffix == ".txt":
        texts = [content]
    else:
        texts = []
        for line_number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DualFlowUserError(f"{path}:{line_number} is not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DualFlowUserError(f'{path}:{line_number} has no string "text" field')
            texts.append(record["text"])
    if not any(text.strip() for text in texts):
        raise DualFlowUserError(f"data file {path} holds no text")
    return texts


def pack_blocks(texts: list[str], tokenizer, block_size: int) -> torch.Tensor:
    """Tokenize, join the documents with EOS and cut into (num_blocks, block_size); the short tail is dropped."""
    token_ids = []
    for text in texts:
        token_ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            token_ids.append(tokenizer.eos_token_id)
    num_blocks = len(token_ids) // block_size
    if num_blocks < 2:
        raise DualFlowUserError(
            f"the data has {len(token_ids)} tokens: at least 2 blocks of --block-size {block_size} are needed "
            "(more text or a smaller --block-size)"
        )
    return torch.tensor(token_ids[: num_blocks * block_size]).view(num_blocks, block_size)


def split_blocks(blocks: torch.Tensor, eval_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle the blocks with `seed` and hold out `eval_fraction` of them (at least one) for evaluation."""
    if not 0 < eval_fraction < 1:
        raise DualFlowUserError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    num_eval = min(max(1, round(len(blocks) * eval_fraction)), len(blocks) - 1)
    return blocks[order[num_eval:]], blocks[order[:num_eval]]


def as_examples(blocks: torch.Tensor) -> list[dict]:
    """Causal-LM examples (the model shifts the labels itself)."""
    return [{"input_ids": block, "labels": block} for block in blocks]


def make_trainer(
    model,
    train_blocks: torch.Tensor,
    eval_blocks: torch.Tensor | None,
    output_dir,
    batch_size: int = 8,
    gradient_accumulation_steps: int = 1,
    learning_rate: float = 1e-4,
    epochs: float = 1.0,
    max_steps: int = -1,
    bf16: bool = False,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    **training_arguments,
) -> Trainer:
    """A plain `transformers.Trainer` over packed blocks; extra keyword arguments go to `TrainingArguments`."""
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=learning_rate,
        num_train_epochs=epochs,
        max_steps=max_steps,
        bf16=bf16,
        # bf16 autocast also runs on CPU, but Trainer only allows it there when told to use the CPU.
        use_cpu=bf16 and not torch.cuda.is_available(),
        activation_checkpointing=gradient_checkpointing,
        seed=seed,
        save_strategy="no",
        report_to="none",
        **training_arguments,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=as_examples(train_blocks),
        eval_dataset=as_examples(eval_blocks) if eval_blocks is not None else None,
    )


@dataclass
class FinetuneResult:
    output_dir: Path
    eval_loss_before: float
    eval_loss_after: float
    trainable_parameters: int


def load_tokenizer(model_path):
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as error:
        raise DualFlowUserError(
            f"no tokenizer found for {model_path} ({str(error).splitlines()[0]}); "
            "save one into the model folder with tokenizer.save_pretrained(...)"
        ) from None


def _check_output_dir(output_dir: Path):
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise DualFlowUserError(f"output directory {output_dir} already exists and is not empty")


def finetune(
    model_path,
    data_path,
    output_dir,
    lora: bool = False,
    aux_only: bool = False,
    block_size: int = 512,
    eval_fraction: float = 0.1,
    lora_r: int = 16,
    lora_alpha: int = 32,
    **trainer_options,
) -> FinetuneResult:
    """
    Fine-tune `model_path` on `data_path` and save the result into `output_dir`: the full model (loadable with
    `AutoModelForCausalLM`, also as remote code) or, with `lora`, the adapter (load it with `peft.PeftModel.from_pretrained`).
    `trainer_options` go to `make_trainer`. The folder appears only once everything is written.
    """
    if lora and aux_only:
        raise DualFlowUserError("--lora and --aux-only are exclusive (LoRA already trains the aux parameters in full)")
    if block_size < 2:  # a block of one token has no next token to predict: the loss would be NaN
        raise DualFlowUserError(f"--block-size must be >= 2, got {block_size}")
    if trainer_options.get("gradient_accumulation_steps", 1) < 1:
        raise DualFlowUserError(f"--grad-accum must be >= 1, got {trainer_options['gradient_accumulation_steps']}")
    output_dir = Path(output_dir)
    _check_output_dir(output_dir)
    texts = read_texts(data_path)
    config = load_dualflow_config(model_path)
    tokenizer = load_tokenizer(model_path)
    block_size = min(block_size, config.max_position_embeddings)
    train_blocks, eval_blocks = split_blocks(pack_blocks(texts, tokenizer, block_size), eval_fraction)
    print(f"data: {len(train_blocks)} train / {len(eval_blocks)} eval blocks of {block_size} tokens")
    model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32)

    if aux_only:
        model.freeze_for_aux_training()
    # The router balance loss is part of the training objective (docs/design.md §3); restored before saving.
    saved_router_setting = model.config.output_router_logits
    model.config.output_router_logits = bool(model.config.num_experts)
    if lora:
        model = add_lora(model, lora_r, lora_alpha)
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    print(f"trainable parameters: {trainable:,}")

    with tempfile.TemporaryDirectory(prefix="dualflow-finetune-") as work_dir:
        trainer = make_trainer(model, train_blocks, eval_blocks, work_dir, **trainer_options)
        before = trainer.evaluate()["eval_loss"]
        print(f"eval loss before: {before:.4f}")
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
        print(f"eval loss after: {after:.4f}")

    model.config.output_router_logits = saved_router_setting
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-", dir=output_dir.parent))
    try:
        if lora:
            model.save_pretrained(staging)
        else:
            model.save_pretrained(staging)
            mode = "aux-only" if aux_only else "full"
            write_model_card(
                staging,
                model.config,
                repo_id=str(output_dir),
                license=license_of(model_path),
                extra=f"Fine-tuned ({mode}) with `dualflow finetune` on `{Path(data_path).name}`: "
                f"eval loss {before:.4f} -> {after:.4f}.",
            )
        tokenizer.save_pretrained(staging)
        if output_dir.exists():
            output_dir.rmdir()  # empty, checked above
        os.replace(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"saved {'adapter' if lora else 'model'} to {output_dir}")
    return FinetuneResult(output_dir, before, after, trainable)


def register(subparsers):
    parser = subparsers.add_parser(
        "finetune",
        help="fine-tune a Dual-Flow model on a .txt / .jsonl corpus with transformers.Trainer",
        description=__doc__.strip().splitlines()[0],
    )
    parser.add_argument("model", help="Dual-Flow model folder (or Hub id) with a tokenizer")
    parser.add_argument(
        "--data", required=True, help='FILE.txt (one document) or FILE.jsonl (one {"text": ...} per line)'
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lora", action="store_true", help="train LoRA adapters + the aux parameters; saves the adapter")
    mode.add_argument(
        "--aux-only",
        action="store_true",
        help="train only the aux flow's own parameters (embedding, couplings, round gates)",
    )
    parser.add_argument("--output-dir", help="where to save (default: ./<model name>-finetuned or -lora)")
    parser.add_argument("--epochs", type=float, default=1.0, help="training epochs (default 1)")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; overrides --epochs when > 0")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per device batch (default 8)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per training block (default 512)")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="share of blocks held out (default 0.1)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU, or CPU when no GPU is present)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations to save memory")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args) -> int:
    suffix = "lora" if args.lora else "finetuned"
    output_dir = args.output_dir or f"{Path(args.model).name}-{suffix}"
    finetune(
        args.model,
        args.data,
        output_dir,
        lora=args.lora,
        aux_only=args.aux_only,
        block_size=args.block_size,
        eval_fraction=args.eval_fraction,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        epochs=args.epochs,
        max_steps=args.max_steps,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        seed=args.seed,
    )
    return 0
