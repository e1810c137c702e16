"""Tiny byte-level MoE language models trained from scratch: the built-in model of `dualflow compare` and the arms of
`dualflow experiment`. A plain AdamW loop: at this size it is much faster than `Trainer` and easy to read."""

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM
from modeling_dualflow.modeling_dualflow import DualFlowExperts, DualFlowRouter

from ..scoring import next_token_nll
from .aux_design import apply_aux_design
from .data import BYTE_VOCAB_SIZE, random_batch
from .scale import TinyScale


def tiny_moe_config(
    scale: TinyScale, top_k: int, aux_top_k: int | None = None, depth_factor: int = 1, **overrides
) -> DualFlowConfig:
    """Byte-level MoE config; `aux_top_k=None` makes a single-flow model (aux flow off by default). `overrides` are
    further `DualFlowConfig` fields."""
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
        router_aux_loss_coef=scale.router_aux_loss_coef,
        **overrides,
    )


@torch.no_grad()
def torch_default_init(model: DualFlowForCausalLM) -> None:
    """
    PyTorch's layer defaults instead of the model's N(0, initializer_range): embeddings N(0, 1), linear layers and the
    router uniform(+-1/sqrt(fan_in)), experts N(0, 1/fan_in). Norms stay 1 and couplings 0. At tiny width this init
    trained Dual-Flow better than transformers' 0.02 in the project's measurements. `aux_embed_init="copy"` still holds.
    """
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.reset_parameters()
        elif isinstance(module, DualFlowExperts):
            torch.nn.init.normal_(module.gate_up_proj, std=module.hidden_dim**-0.5)
            torch.nn.init.normal_(module.down_proj, std=module.intermediate_dim**-0.5)
        elif isinstance(module, DualFlowRouter):
            bound = module.weight.shape[1] ** -0.5
            torch.nn.init.uniform_(module.weight, -bound, bound)
    if model.config.aux_embed_init == "copy":  # the copy the model's own init made, of the new draw
        model.model.aux_embed_tokens.weight.copy_(model.model.embed_tokens.weight)


def train_language_model(
    config: DualFlowConfig,
    train_tokens: torch.Tensor,
    scale: TinyScale,
    seed: int,
    steps: int | None = None,
    desc: str = "train",
    show_progress: bool = True,
    aux_design: dict | None = None,
) -> tuple[DualFlowForCausalLM, list[float]]:
    """
    Train from scratch; returns (model in eval mode, per-step training NLL of the prediction). The loss is the model's
    own (from labels): CE(prediction) (+ primary_loss_weight * CE(primary) with the aux flow on) + router balance loss. The seed
    fixes both the initial weights and the sequence of batches, so arms with equal seeds see the same data.
    `aux_design`: keyword arguments of `aux_design.apply_aux_design` (a design variant of the aux flow), applied after
    the init.
    """
    steps = steps or scale.steps
    torch.manual_seed(seed)
    model = DualFlowForCausalLM(config)
    if scale.init == "torch":
        torch_default_init(model)
    if aux_design:
        apply_aux_design(model, **aux_design)
    return model, train_model(model, train_tokens, scale, seed, steps, desc, show_progress)


def train_model(
    model,
    train_tokens: torch.Tensor,
    scale: TinyScale,
    batch_seed: int,
    steps: int,
    desc: str = "train",
    show_progress: bool = True,
    round_gate_lr_factor: float = 1.0,
) -> list[float]:
    """
    Train the parameters of `model` that require grad on `steps` batches drawn with `batch_seed`, with the recipe of
    `scale` (AdamW, linear warmup, cosine decay to 10% of the peak); leaves the model in eval mode and returns the
    per-step training NLL of the prediction. `round_gate_lr_factor` scales the learning rate of the aux round gates
    (AdamW moves a parameter by about the rate per step, so closed gates open that much faster).
    """
    model.train()
    named = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    trainable = [parameter for _, parameter in named]
    groups = [{"params": trainable}]
    if round_gate_lr_factor != 1:  # the gates in a group of their own (only then: the other runs stay as they were)
        gates = [parameter for name, parameter in named if ".aux_round_gate." in name]
        groups = [
            {"params": [parameter for name, parameter in named if ".aux_round_gate." not in name]},
            {"params": gates, "lr": scale.learning_rate * round_gate_lr_factor},
        ]
    optimizer = torch.optim.AdamW(
        groups, lr=scale.learning_rate, betas=(0.9, scale.adam_beta2), weight_decay=scale.weight_decay
    )
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, scale.warmup_steps, steps, min_lr_rate=0.1)
    batches = torch.Generator().manual_seed(batch_seed)
    curve = []
    for _ in tqdm(range(steps), desc=desc, disable=not show_progress, leave=False):
        input_ids = random_batch(train_tokens, scale.batch_size, scale.block_size, batches)
        outputs = model(input_ids, labels=input_ids, output_router_logits=True)
        outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(next_token_nll(outputs.logits.detach(), input_ids).item())
    model.eval()
    return curve
