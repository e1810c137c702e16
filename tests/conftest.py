"""Shared fixtures: tiny configs/models and a hermetic remote-code cache per test session."""

import os
import tempfile


# transformers reads HF_MODULES_CACHE at import: point it at a private folder before anything imports it.
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="dualflow-hf-modules-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM  # noqa: E402


TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_intermediate_size=24,
    max_position_embeddings=128,
    # Tests compare the aux flow with the primary one: an aux embedding of its own keeps the flows apart from the start
    # (new models copy the primary embedding by default).
    aux_embed_init="independent",
)


def tiny_config(**overrides) -> DualFlowConfig:
    """A tiny MoE Dual-Flow config (4 experts, k_p=2); pass num_experts=0 for a dense one."""
    fields = dict(TINY, num_experts=4, num_experts_per_tok=2)
    fields.update(overrides)
    return DualFlowConfig(**fields)


def tiny_model(seed: int = 0, random_coupling: bool = True, attn_implementation: str = "sdpa", **overrides):
    """
    Random tiny model in eval mode; non-zero couplings (and round gates and adapter deltas, where the config has them)
    so the aux flow differs from the primary one.
    """
    torch.manual_seed(seed)
    model = DualFlowForCausalLM(tiny_config(**overrides)).eval()
    model.set_attn_implementation(attn_implementation)
    if random_coupling:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.aux_coupling.weight.normal_(std=0.5)
                if hasattr(layer, "aux_round_gate"):
                    layer.aux_round_gate.weight.normal_(mean=0.5, std=0.5)
            for name, parameter in model.named_parameters():
                if name.endswith("_adapter.up"):
                    parameter.normal_(std=0.2)
    return model


def enable_activation_checkpointing(model, checkpoint_kwargs: dict | None = None):
    """transformers 5.23 renamed `gradient_checkpointing_enable` (the old name warns there); 5.19-5.22 have only it."""
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)(checkpoint_kwargs)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
