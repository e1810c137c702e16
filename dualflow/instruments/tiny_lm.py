"""Tiny byte-level MoE language models trained from scratch: the built-in model of `dualflow compare` and the arms of
`dualflow experiment`. A plain AdamW loop: at this size it is much faster than `Trainer` and easy to read."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM

from .data import BYTE_VOCAB_SIZE, random_batch


@dataclass(frozen=True)
class TinyScale:
    """Model and training sizes of the tiny runs."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_experts: int = 8
    moe_intermediate_size: int = 64
    block_size: int = 128
    batch_size: int = 16
    steps: int = 400
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    eval_blocks: int = 64


def tiny_moe_config(
    scale: TinyScale, top_k: int, aux_top_k: int | None = None, depth_factor: int = 1
) -> DualFlowConfig:
    """Byte-level MoE config; `aux_top_k=None` makes a single-flow model (aux flow off by default)."""
    return DualFlowConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=scale.hidden_size,
        intermediate_size=4 * scale.hidden_size,
        num_hidden_layers=scale.num_hidden_layers * depth_factor,
        num_attention_heads=scale.num_attention_heads,
        num_key_value_heads=scale.num_key_value_heads,
        num_experts=scale.num_experts,
        num_experts_per_tok=top_k,
        aux_num_experts_per_tok=aux_top_k or top_k,
        moe_intermediate_size=scale.moe_intermediate_size,
        max_position_embeddings=max(scale.block_size, 2048),
        use_aux_flow=aux_top_k is not None,
    )


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of tokens 1.. given the logits at positions ..-1 (logits: (batch, T, vocab))."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


@torch.no_grad()
def mean_token_nll(model, blocks: torch.Tensor, batch_size: int = 8, **forward_kwargs) -> float:
    """
    Mean next-token NLL (nats) over every predicted token of `blocks` (num_blocks, T); `forward_kwargs` go to the
    model (e.g. `use_aux_flow=False`). Every block has the same length, so the mean of block means is the token mean.
    """
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(model.device)
        logits = model(batch, **forward_kwargs).logits
        total += next_token_nll(logits, batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    return total / count


def _lr_lambda(warmup_steps: int, total_steps: int):
    # Linear warmup, then cosine decay to 10% of the peak.
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_language_model(
    config: DualFlowConfig,
    train_tokens: torch.Tensor,
    scale: TinyScale,
    seed: int,
    steps: int | None = None,
    desc: str = "train",
    show_progress: bool = True,
) -> tuple[DualFlowForCausalLM, list[float]]:
    """
    Train from scratch; returns (model in eval mode, per-step training NLL of the prediction). The loss is the model's
    own (from labels): CE(prediction) (+ primary_loss_weight * CE(primary) with the aux flow on) + router balance loss. The seed
    fixes both the initial weights and the sequence of batches, so arms with equal seeds see the same data.
    """
    steps = steps or scale.steps
    torch.manual_seed(seed)
    model = DualFlowForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=scale.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(scale.warmup_steps, steps))
    batches = torch.Generator().manual_seed(seed)
    curve = []
    for _ in tqdm(range(steps), desc=desc, disable=not show_progress, leave=False):
        input_ids = random_batch(train_tokens, scale.batch_size, scale.block_size, batches)
        outputs = model(input_ids, labels=input_ids, output_router_logits=True)
        outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(next_token_nll(outputs.logits.detach(), input_ids).item())
    return model.eval(), curve
