"""DualFlow model configuration."""

import math

from huggingface_hub.dataclasses import strict
from transformers import Qwen3MoeConfig
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import logging


logger = logging.get_logger(__name__)


QK_NORM_KINDS = (None, "per_head", "full")
AUX_EMBED_INITS = ("independent", "copy")
# Fields of earlier versions that a saved config may still carry: read, ignored, and dropped with one warning.
RETIRED_FIELDS = ("aux_train_fraction", "aux_train_positions")


@strict
class DualFlowConfig(PreTrainedConfig):
    r"""
    Configuration of a Dual-Flow causal LM: a standard decoder (dense or MoE, Llama / Mistral / Qwen / Mixtral
    / OLMoE style) whose primary flow processes the prompt and owns the KV cache, plus an auxiliary flow that
    runs only where a next-token prediction is needed. Field names follow transformers' own configs.

    Family-specific fields:
        qkv_bias (`bool`, *optional*):
            Bias on the q/k/v projections; `None` follows `attention_bias`, which also sets the o_proj bias
            (Qwen2-style models: `qkv_bias=True, attention_bias=False`).
        qk_norm (`str`, *optional*):
            `"per_head"` (Qwen3: RMSNorm over head_dim), `"full"` (OLMoE: RMSNorm over the whole q / k
            projection) or `None`.
        clip_qkv (`float`, *optional*):
            Clamp q/k/v to [-clip_qkv, clip_qkv] (OLMoE).
        num_experts (`int`):
            0 builds dense MLPs and ignores every top-k field.
        shared_expert_intermediate_size (`int`):
            > 0 adds a Qwen2-MoE shared expert with a sigmoid gate.

    Dual-Flow fields:
        aux_num_experts_per_tok (`int`, *optional*):
            Expert top-k of the auxiliary flow (k_a); defaults to `num_experts_per_tok` (k_p).
        primary_loss_weight (`float`):
            Training loss = CE(aux) + primary_loss_weight * CE(primary).
        use_aux_flow (`bool`):
            Default for the `use_aux_flow` argument of `forward` and `generate`.
        aux_num_rounds (`int`):
            Passes of the aux flow through the layers (R). Rounds after the first run the aux rows alone
            against the primary keys/values of the first round and write nothing; each layer gates their
            residual updates with an `aux_round_gate` that starts at `aux_round_gate_init` (open in a new
            model, closed in a converted one, which so still computes as its source). 1 (the default) is the
            paper's form and builds no gates.
        aux_embed_init (`str`):
            How a model built from scratch starts its aux token embedding: "copy" (the default: a copy of the
            primary embedding, as conversion writes; it trained better from scratch in the Dual-Flow
            experiments) or "independent" (a random draw of its own, like any embedding). Loaded weights are
            never touched.
        aux_round_gate_init (`float`, *optional*):
            The value the round gates start at when weights are initialised (a model built from scratch, or
            gates a checkpoint lacks). `None` (the default) means 1 for a config made with more than one aux
            round (open gates trained better from scratch in the Dual-Flow experiments) and 0 otherwise; the
            config stores the number, so a saved model keeps it. 0 makes the extra rounds start as the
            identity, which conversion writes.
        aux_adapter_rank (`int`):
            Rank of the aux adapters: low-rank deltas on each layer's q_proj, o_proj and MLP / MoE block
            output that act on aux rows only (`aux_q_adapter`, `aux_o_adapter`, `aux_mlp_adapter`). Their up
            projection starts at zero, so a converted model still computes as its source. 0 (the default)
            builds none. Under tensor parallelism the q_proj adapter is split column-wise and the o_proj one
            row-wise, as those projections are; the MLP output's is replicated.
    """

    model_type = "dualflow"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # "cache" from transformers 5.24 on
    default_theta = 10000.0

    # Qwen3-MoE's plan of the installed transformers, whose module names these are: up to 5.24 it splits each
    # expert's weights over the ranks, from 5.25 on it keeps the experts whole (expert parallelism splits
    # them).
    base_model_tp_plan = Qwen3MoeConfig.base_model_tp_plan | {
        # the aux adapters split as the projections they adapt: each rank adds the delta of its own heads
        "layers.*.self_attn.aux_q_adapter": Qwen3MoeConfig.base_model_tp_plan["layers.*.self_attn.q_proj"],
        "layers.*.self_attn.aux_o_adapter": Qwen3MoeConfig.base_model_tp_plan["layers.*.self_attn.o_proj"],
    }
    # `qk_norm="full"` (OLMoE) normalises the whole q / k projection, which a head-sharded projection cannot
    # do: those models gather the projections' output instead, as transformers' OLMoE plan does.
    full_qk_norm_attention_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise_gather_output",
        "layers.*.self_attn.k_proj": "colwise_gather_output",
        "layers.*.self_attn.v_proj": "colwise_gather_output",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
    }
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    # transformers' default FSDP2 plan plus the aux embedding, a full vocabulary table that gets its own unit.
    base_model_fsdp_plan = {
        "embed_tokens": "free_full_weight",
        "aux_embed_tokens": "free_full_weight",
        "layers.*": "free_full_weight",
        "norm": "keep_full_weight",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float | int = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    qkv_bias: bool | None = None
    qk_norm: str | None = None
    clip_qkv: float | None = None
    attention_dropout: float | int = 0.0
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    router_aux_loss_coef: float | int = 0.001
    output_router_logits: bool = False
    aux_num_experts_per_tok: int | None = None
    primary_loss_weight: float | int = 1.0
    use_aux_flow: bool = True
    aux_embed_init: str = "copy"
    aux_num_rounds: int = 1
    aux_round_gate_init: float | int | None = None
    aux_adapter_rank: int = 0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        retired = [name for name in RETIRED_FIELDS if kwargs.pop(name, None) is not None]
        if retired:
            logger.warning(f"{', '.join(retired)}: no longer a Dual-Flow config field, ignored")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when head_dim is not given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        if self.aux_num_experts_per_tok is None:
            self.aux_num_experts_per_tok = self.num_experts_per_tok
        if self.aux_round_gate_init is None:
            self.aux_round_gate_init = 1.0 if self.aux_num_rounds > 1 else 0.0
        # Checked here rather than in a `validate_*` hook: @strict wraps those errors in another type.
        self._check_fields()
        self._plans_for_existing_modules()
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        # transformers only warns, then builds a randomly initialised model from another architecture's config
        model_type = config_dict.get("model_type")
        if model_type not in (None, cls.model_type):
            raise ValueError(
                f"{pretrained_model_name_or_path} holds a {model_type!r} checkpoint, not a Dual-Flow one: "
                "convert it first (pip install dualflow-transformers; "
                f"dualflow convert {pretrained_model_name_or_path} OUT)"
            )
        return config_dict, kwargs

    def to_dict(self) -> dict:
        config_dict = super().to_dict()
        # Saved as remote code, the model file also holds the base model: AutoModel finds it beside the causal
        # LM.
        causal_lm = (config_dict.get("auto_map") or {}).get("AutoModelForCausalLM")
        if causal_lm is not None:
            base_model = causal_lm.rsplit(".", 1)[0] + ".DualFlowModel"
            config_dict["auto_map"] = {"AutoModel": base_model} | config_dict["auto_map"]
        return config_dict

    def _plans_for_existing_modules(self):
        """
        The tensor-parallel plan names only modules this config builds (experts, dense MLPs, q/k norms, aux
        adapters).
        """
        plan = dict(type(self).base_model_tp_plan)
        if self.qk_norm == "full":
            plan = {key: style for key, style in plan.items() if not key.endswith("_norm")}
            plan |= self.full_qk_norm_attention_tp_plan
        elif self.qk_norm is None:
            plan = {key: style for key, style in plan.items() if not key.endswith("_norm")}
        # gathered projections (`qk_norm="full"`) are adapted by whole adapters, replicated like the MLP's
        if self.qk_norm == "full" or not self.aux_adapter_rank:
            plan = {key: style for key, style in plan.items() if "_adapter" not in key}
        moe_layers = [self.is_moe_layer(i) for i in range(self.num_hidden_layers)]
        if not any(moe_layers):
            plan = {key: style for key, style in plan.items() if ".experts" not in key}
        if all(moe_layers):
            dense_mlp = ("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj")
            plan = {key: style for key, style in plan.items() if key not in dense_mlp}
        if plan != type(self).base_model_tp_plan:
            self.base_model_tp_plan = plan

    def _check_fields(self):
        """Raise a ValueError naming the first inconsistent field."""
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "moe_intermediate_size",
        )
        for name in (*positive, "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for name in ("primary_loss_weight", "router_aux_loss_coef"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.aux_round_gate_init):
            raise ValueError(f"aux_round_gate_init must be a finite number, got {self.aux_round_gate_init}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of transformers' activations")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"clip_qkv must be None or > 0, got {self.clip_qkv}")
        if self.qk_norm not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm must be one of {QK_NORM_KINDS}, got {self.qk_norm!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")
        if self.aux_embed_init not in AUX_EMBED_INITS:
            raise ValueError(f"aux_embed_init must be one of {AUX_EMBED_INITS}, got {self.aux_embed_init!r}")
        if self.aux_adapter_rank < 0:
            raise ValueError(f"aux_adapter_rank must be >= 0 (0 = no adapters), got {self.aux_adapter_rank}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0 = dense), got {self.num_experts}")
        self.check_aux_settings(self.aux_num_experts_per_tok, self.aux_num_rounds)
        if self.num_experts == 0:  # dense: the top-k fields are not used
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise ValueError(
                f"mlp_only_layers holds layer indices outside [0, {self.num_hidden_layers}): {bad_layers}"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}"
            )

    def check_aux_settings(self, aux_num_experts_per_tok, aux_num_rounds) -> None:
        """Raises an error naming a bad aux top-k or number of aux rounds: the config's own, or one call's."""
        for name, value in (
            ("aux_num_experts_per_tok", aux_num_experts_per_tok),
            ("aux_num_rounds", aux_num_rounds),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if aux_num_rounds < 1:
            raise ValueError(f"aux_num_rounds must be >= 1, got {aux_num_rounds}")
        if self.num_experts == 0 and aux_num_experts_per_tok != self.num_experts_per_tok:
            # dense: the top-k fields are not used, but an aux top-k of its own asks for experts
            raise ValueError(
                f"aux_num_experts_per_tok={aux_num_experts_per_tok} needs a MoE model (num_experts > 0); "
                "this model is dense"
            )
        if self.num_experts and not 1 <= aux_num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"aux_num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {aux_num_experts_per_tok}"
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


__all__ = ["DualFlowConfig"]
