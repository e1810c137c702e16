"""Mean next-token NLL of a causal LM over fixed blocks of tokens: how `dualflow finetune` and the instruments score a
model's flows."""

import torch
import torch.nn.functional as F


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of tokens 1.. given the logits at positions ..-1 (logits: (batch, T, vocab))."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


def mean_token_nll(model, blocks: torch.Tensor, batch_size: int = 8, **forward_kwargs) -> float:
    """
    Mean next-token NLL (nats) over every predicted token of `blocks` (num_blocks, T); `forward_kwargs` go to the
    model (e.g. `use_aux_flow=False`). Every block has the same length, so the mean of block means is the token mean.
    """
    return mean_token_nlls(model, blocks, ("logits",), batch_size, **forward_kwargs)["logits"]


@torch.no_grad()
def mean_token_nlls(model, blocks: torch.Tensor, fields, batch_size: int = 8, **forward_kwargs) -> dict[str, float]:
    """`mean_token_nll` of several logits fields of one forward pass, e.g. ("logits", "primary_logits") with the aux
    flow on scores the prediction and the primary flow at the cost of one pass."""
    totals, count = dict.fromkeys(fields, 0.0), 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(model.device)
        outputs = model(batch, **forward_kwargs)
        for field in fields:
            totals[field] += next_token_nll(outputs[field], batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    return {field: total / count for field, total in totals.items()}
