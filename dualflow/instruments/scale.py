"""The sizes of the tiny runs, in a module of their own without torch (`dualflow experiment --help` reads them)."""

from dataclasses import dataclass


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
    weight_decay: float = 0.1
    adam_beta2: float = 0.95
    router_aux_loss_coef: float = 0.001
    # "model": the model's own init (normal with `initializer_range`); "torch": PyTorch's layer defaults.
    init: str = "model"
