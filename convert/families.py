"""Per-family knowledge: how each supported source config maps to a DualFlowConfig, and the Hub names of its experts.

Everything except the routed experts already has the same tensor name in every supported family and in Dual-Flow
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so a family only has to say where its router and per-expert
matrices live in the layout `save_pretrained` writes by default. The fused layout (`save_original_format=False`)
uses transformers' in-memory names, which are Dual-Flow's names too.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from dualflow.errors import DualFlowUserError


@dataclass(frozen=True)
class ExpertNames:
    """Tensor names of one layer's router and expert `e`, relative to `model.layers.{i}.`."""

    router: str
    gate: str
    up: str
    down: str


QWEN_STYLE_EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
)
MIXTRAL_EXPERTS = ExpertNames(  # w1 = gate, w3 = up, w2 = down
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{e}.w1.weight",
    up="block_sparse_moe.experts.{e}.w3.weight",
    down="block_sparse_moe.experts.{e}.w2.weight",
)


def _sliding_window(source_config) -> int | None:
    """The one window Dual-Flow can apply to every layer, or None when the source attends fully everywhere."""
    layer_types = getattr(source_config, "layer_types", None)
    window = getattr(source_config, "sliding_window", None) or None  # Qwen2-MoE stores 0 for "off"
    if layer_types is None:
        return window
    sliding = {kind == "sliding_attention" for kind in layer_types}
    if sliding == {True, False}:
        raise DualFlowUserError(
            f"{source_config.model_type} config uses sliding-window attention on some layers only (layer_types); "
            "Dual-Flow applies one window to all layers"
        )
    return window if sliding == {True} else None


def _common_fields(source_config) -> dict:
    rope_parameters = getattr(source_config, "rope_parameters", None)
    return dict(
        vocab_size=source_config.vocab_size,
        hidden_size=source_config.hidden_size,
        intermediate_size=source_config.intermediate_size,
        num_hidden_layers=source_config.num_hidden_layers,
        num_attention_heads=source_config.num_attention_heads,
        num_key_value_heads=source_config.num_key_value_heads,
        head_dim=getattr(source_config, "head_dim", None),
        hidden_act=source_config.hidden_act,
        max_position_embeddings=source_config.max_position_embeddings,
        initializer_range=source_config.initializer_range,
        rms_norm_eps=source_config.rms_norm_eps,
        tie_word_embeddings=source_config.tie_word_embeddings,
        rope_parameters=dict(rope_parameters) if rope_parameters is not None else None,
        attention_dropout=source_config.attention_dropout,
        sliding_window=_sliding_window(source_config),
        pad_token_id=source_config.pad_token_id,
        bos_token_id=source_config.bos_token_id,
        eos_token_id=source_config.eos_token_id,
    )


def _moe_fields(source_config, num_experts: int, moe_intermediate_size: int) -> dict:
    # A MoE family with no experts would be read as a dense model, and fail on tensors the checkpoint does not have.
    if not isinstance(num_experts, int) or num_experts < 1:
        raise DualFlowUserError(
            f"{source_config.model_type} config has {num_experts!r} experts: a MoE checkpoint needs at least 1"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=source_config.num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        router_aux_loss_coef=source_config.router_aux_loss_coef,
        output_router_logits=source_config.output_router_logits,
    )


def _llama_fields(c):
    if getattr(c, "mlp_bias", False):
        raise DualFlowUserError("llama config has mlp_bias=true; Dual-Flow MLPs have no bias")
    return dict(attention_bias=c.attention_bias)


def _mixtral_fields(c):
    # Mixtral always renormalises the top-k routing weights; its experts use intermediate_size.
    return dict(norm_topk_prob=True, **_moe_fields(c, c.num_local_experts, c.intermediate_size))


def _olmoe_fields(c):
    return dict(
        attention_bias=c.attention_bias,
        qk_norm="full",
        clip_qkv=c.clip_qkv,
        norm_topk_prob=c.norm_topk_prob,
        **_moe_fields(c, c.num_experts, c.intermediate_size),
    )


def _qwen3_moe_fields(c):
    return dict(
        attention_bias=c.attention_bias,
        qk_norm="per_head",
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=c.decoder_sparse_step,
        mlp_only_layers=list(c.mlp_only_layers),
        **_moe_fields(c, c.num_experts, c.moe_intermediate_size),
    )


def _qwen2_moe_fields(c):
    return dict(
        qkv_bias=c.qkv_bias,
        attention_bias=False,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=c.decoder_sparse_step,
        mlp_only_layers=list(c.mlp_only_layers),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        **_moe_fields(c, c.num_experts, c.moe_intermediate_size),
    )


@dataclass(frozen=True)
class Family:
    model_type: str
    # DualFlowConfig fields beyond the common ones, from the (transformers-parsed) source config.
    specific_fields: Callable = field(repr=False)
    experts: ExpertNames | None = None  # None: dense family

    def dualflow_config_fields(self, source_config) -> dict:
        return {**_common_fields(source_config), **self.specific_fields(source_config)}


FAMILIES = {
    family.model_type: family
    for family in [
        Family("mixtral", _mixtral_fields, MIXTRAL_EXPERTS),
        Family("qwen2_moe", _qwen2_moe_fields, QWEN_STYLE_EXPERTS),
        Family("qwen3_moe", _qwen3_moe_fields, QWEN_STYLE_EXPERTS),
        Family("olmoe", _olmoe_fields, QWEN_STYLE_EXPERTS),
        Family("llama", _llama_fields),
        Family("mistral", lambda c: {}),
        Family("qwen2", lambda c: dict(qkv_bias=True, attention_bias=False)),
        Family("qwen3", lambda c: dict(attention_bias=c.attention_bias, qk_norm="per_head")),
    ]
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_for(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise DualFlowUserError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return FAMILIES[model_type]
