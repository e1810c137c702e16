"""What `dualflow compare` measures: a checkpoint folder or the built-in tiny MoE (trained in-process), and its data."""

import torch

from modeling_dualflow import DualFlowForCausalLM

from ..checkpoint import has_tokenizer, load_dualflow_config, load_tokenizer
from ..errors import DualFlowUserError
from .data import BYTE_VOCAB_SIZE, check_data_files, read_byte_tokens, split_files, stdlib_source_files
from .tiny_lm import TinyScale, tiny_moe_config, train_language_model


DEFAULT_DATA_FILES = 4  # held-out stdlib files scored when no --data is given


def builtin_model(steps: int, show_progress: bool = True, aux_rounds: int = 1) -> DualFlowForCausalLM:
    """Tiny byte-level MoE (8 experts, k_p=2, k_a=4, `aux_rounds` aux rounds) briefly trained on stdlib code, so its
    losses mean something."""
    scale = TinyScale()
    train_files, _ = split_files(stdlib_source_files())
    train_tokens = read_byte_tokens(train_files, max_tokens=4_000_000)
    # One thread: these matmuls are too small to gain from a second one, and one thread a run is faster when other work shares the CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = train_language_model(
            tiny_moe_config(scale, top_k=2, aux_top_k=4, aux_num_rounds=aux_rounds),
            train_tokens,
            scale,
            seed=0,
            steps=steps,
            desc="training the built-in model",
            show_progress=show_progress,
        )
    finally:
        torch.set_num_threads(threads)
    return model


def load_checkpoint(path) -> tuple[DualFlowForCausalLM, object | None]:
    """(model, tokenizer) of a Dual-Flow folder; tokenizer None (byte-level ids) for a folder without one."""
    config = load_dualflow_config(path)
    if has_tokenizer(path):
        tokenizer = load_tokenizer(path)
    elif config.vocab_size >= BYTE_VOCAB_SIZE:
        tokenizer = None
    else:
        load_tokenizer(path)  # raises, saying what to add
    return DualFlowForCausalLM.from_pretrained(path, config=config).eval(), tokenizer


def data_tokens(data_paths, tokenizer) -> tuple[torch.Tensor, list[str]]:
    """1-D token ids of the data (byte-level when `tokenizer` is None) and the file names used."""
    if data_paths:
        files = check_data_files(data_paths)
    else:
        files = split_files(stdlib_source_files())[1][:DEFAULT_DATA_FILES]
    if tokenizer is None:
        tokens = read_byte_tokens(files).long()
    else:
        text = "\n\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if len(tokens) < 2:
        raise DualFlowUserError(f"the data holds {len(tokens)} token(s): nothing to measure")
    return tokens, [str(path) for path in files]
