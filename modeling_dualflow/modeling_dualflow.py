"""
PyTorch Dual-Flow causal LM (arXiv 2608.12385; the design is documented with the dualflow-transformers
package).

Every layer works on one stacked tensor `(batch, T + P, hidden)`: rows `[:T]` are the primary flow (all input
positions), rows `[T:]` are the auxiliary flow at the `P` positions whose next token is predicted. Shared
weights see both flows in one call (grouped execution); only the primary rows produce keys/values and enter
the cache.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoePreTrainedModel,
    Qwen3MoeTopKRouter,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, is_torchdynamo_compiling
from transformers.utils.generic import is_flash_attention_requested, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .attention_dualflow import (
    DualFlowAttention,
    DualFlowAuxAdapter,
    DualFlowMasks,
    FlowMask,
    add_to_aux_rows,
    aux_rows_mask,
)
from .cache_dualflow import DualFlowCache, check_cache_shapes
from .configuration_dualflow import DualFlowConfig
from .outputs_dualflow import (
    CACHE_FIELD,
    DualFlowCausalLMOutputWithPast,
    DualFlowModelOutputWithPast,
    hidden_states_to_return,
    record_flows,
    returned_hidden_states,
    split_recorded_flows,
    with_cache,
)


class DualFlowExperts(Qwen3MoeExperts):
    """Qwen3-MoE's experts, with the experts kernels transformers offers them."""


def route_two_top_k(
    router_probs: torch.Tensor, is_aux_row: torch.Tensor, top_k: int, aux_top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Each row's top-k of `router_probs` (rows, num_experts) for its flow (`aux_top_k` where `is_aux_row`),
    renormalised when `norm_topk_prob`.

    Returns weights and expert indices of shape (rows, K), K the larger of the two k; the slots past a row's
    own k have weight 0.
    """
    num_slots = max(top_k, aux_top_k)
    weights, indices = torch.topk(router_probs, num_slots, dim=-1)
    if top_k != aux_top_k:
        row_top_k = torch.where(is_aux_row, aux_top_k, top_k)  # (rows,)
        used = torch.arange(num_slots, device=router_probs.device) < row_top_k[:, None]  # (rows, K)
        weights = weights * used
        indices = torch.where(used, indices, indices[:, :1])
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


class DualFlowRouter(Qwen3MoeTopKRouter):
    """Qwen3-MoE's router, shared by both flows: it scores every expert; `route_two_top_k` picks per flow."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, hidden) -> router logits and probabilities, (rows, num_experts) each."""
        router_logits = F.linear(hidden_states, self.weight)
        return router_logits, F.softmax(router_logits, dtype=torch.float, dim=-1)


class DualFlowSparseMoeBlock(nn.Module):
    def __init__(self, config: DualFlowConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        # kept here, not read from the router: PEFT's LoRA on the router wraps it in a module without it
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = DualFlowRouter(config)
        self.experts = DualFlowExperts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert
            self.shared_expert = Qwen2MoeMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor, num_primary: int, aux_top_k: int) -> torch.Tensor:
        """hidden_states: (batch, T + P, hidden), the P aux rows after the T primary rows of each sequence."""
        batch_size, num_rows, hidden_dim = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden_dim)
        if num_rows == num_primary:  # primary rows only: k_p slots, no padding
            aux_top_k = self.top_k
        is_aux_row = (torch.arange(num_rows, device=flat.device) >= num_primary).repeat(batch_size)
        _, router_probs = self.gate(flat)
        norm_topk_prob = self.norm_topk_prob
        weights, indices = route_two_top_k(router_probs, is_aux_row, self.top_k, aux_top_k, norm_topk_prob)
        weights = weights.to(flat.dtype)
        if aux_top_k == self.top_k:  # one fan-out for every row
            output = self.experts(flat, indices, weights)
        else:
            output = self._two_fanouts(flat, weights, indices, batch_size, num_rows, num_primary)
        if self.shared_expert is not None:
            output = output + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return output.view(batch_size, num_rows, hidden_dim)

    def _two_fanouts(self, flat, weights, indices, batch_size, num_rows, num_primary):
        """
        The experts kernels take one top-k for all rows, so every row goes in with its first k_p slots (the
        primary rows' padding past k_p dropped), and each aux row again, in appended copies, with each further
        k_p slots (the last chunk padded at weight 0 on its first expert). Prefill thus pays no extra expert
        compute for k_a.
        """
        k_p = self.top_k
        num_slots = weights.shape[-1]
        num_flat = flat.shape[0]
        chunks = -(-num_slots // k_p)  # ceil(K / k_p)
        if chunks == 1:
            return self.experts(flat, indices[:, :k_p], weights[:, :k_p])
        padding = chunks * k_p - num_slots
        indices = torch.cat([indices, indices[:, :1].expand(-1, padding)], dim=-1)
        weights = F.pad(weights, (0, padding))
        row_index = torch.arange(num_flat, device=flat.device).view(batch_size, num_rows)
        aux_rows = row_index[:, num_primary:].flatten()
        # the appended rows: each aux row's later chunks, in order
        output = self.experts(
            torch.cat([flat, flat[aux_rows].repeat_interleave(chunks - 1, dim=0)]),
            torch.cat([indices[:, :k_p], indices[aux_rows, k_p:].reshape(-1, k_p)]),
            torch.cat([weights[:, :k_p], weights[aux_rows, k_p:].reshape(-1, k_p)]),
        )
        extra_output = output[num_flat:].view(aux_rows.shape[0], chunks - 1, -1).sum(dim=1)
        return output[:num_flat].index_add(0, aux_rows, extra_output)


class DualFlowGain(nn.Module):
    """
    A per-channel gain of the aux flow: `aux_coupling` (c_l, on the primary state the aux rows add; starts at
    0) and `aux_round_gate` (on a later round's residual update; starts at `aux_round_gate_init`). A module of
    its own so that PEFT's `modules_to_save` can name it.
    """

    def __init__(self, hidden_size: int, init_value: float = 0.0):
        super().__init__()
        self.init_value = init_value
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.weight * states


class DualFlowDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DualFlowConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DualFlowAttention(config, layer_idx)
        # a routed MLP gives each flow its own top-k, so it takes the row layout; a dense one sees rows only
        self.routes_flows = config.is_moe_layer(layer_idx)
        if self.routes_flows:
            self.mlp = DualFlowSparseMoeBlock(config)
        else:
            self.mlp = Qwen2MoeMLP(config, config.intermediate_size)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.aux_coupling = DualFlowGain(config.hidden_size)
        self.aux_round_gate = None
        if config.aux_num_rounds > 1:
            self.aux_round_gate = DualFlowGain(config.hidden_size, config.aux_round_gate_init)
        self.aux_mlp_adapter = None
        if config.aux_adapter_rank:
            self.aux_mlp_adapter = DualFlowAuxAdapter(
                config.hidden_size, config.hidden_size, config.aux_adapter_rank
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        coupled_state: torch.Tensor | None = None,
        primary_keys: torch.Tensor | None = None,
        primary_values: torch.Tensor | None = None,
        *,
        num_primary: int,
        masks: DualFlowMasks,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        aux_top_k: int | None = None,
        output_attentions: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        hidden_states (`torch.Tensor` of shape `(batch, T + P, hidden)`):
            The T primary rows, then the P aux rows; T = 0 in an extra aux round.
        coupled_state (`torch.Tensor` of shape `(batch, P, hidden)`, *optional*):
            The primary state entering this layer at the aux positions; None where the aux flow does not run.
        primary_keys, primary_values (`torch.Tensor`, *optional*):
            In an extra aux round, the first round's keys/values of this layer, attended to instead of new
            ones. Positional, so that reentrant checkpointing gives them gradients.
        cache, past_key_values (`Cache`, *optional*):
            The cache, under the installed version's name (`CACHE_FIELD`): the one under which
            `GradientCheckpointingLayer` takes it from a checkpointed layer, whose backward would write it
            again.

        Returns the layer output and the keys/values its attention used.
        """
        cache = past_key_values if cache is None else cache
        is_extra_round = primary_keys is not None
        layer_input = hidden_states
        if coupled_state is not None:
            aux_rows = torch.arange(num_primary, hidden_states.shape[1], device=hidden_states.device)
            hidden_states = hidden_states.index_add(1, aux_rows, self.aux_coupling(coupled_state))

        residual = hidden_states
        hidden_states, _, (keys, values) = self.self_attn(
            self.input_layernorm(hidden_states),
            num_primary,
            position_embeddings,
            masks,
            cache=cache,
            primary_key_values=(primary_keys, primary_values) if is_extra_round else None,
            output_attentions=output_attentions,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        mlp_input = self.post_attention_layernorm(hidden_states)
        if self.routes_flows:
            hidden_states = self.mlp(mlp_input, num_primary, aux_top_k)
        else:
            hidden_states = self.mlp(mlp_input)
        hidden_states = add_to_aux_rows(hidden_states, mlp_input, self.aux_mlp_adapter, num_primary)
        hidden_states = residual + hidden_states
        if is_extra_round:
            hidden_states = layer_input + self.aux_round_gate(hidden_states - layer_input)
        return hidden_states, keys, values


class DualFlowPreTrainedModel(Qwen3MoePreTrainedModel):
    # Qwen3-MoE's capabilities hold: every attention backend (the aux rows attend as extra query heads over
    # the same keys/values, or in a call of their own), fullgraph compile, gradient checkpointing.
    config: DualFlowConfig
    _no_split_modules = ["DualFlowDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    # Serving engines' attention backends (vLLM / TGI through transformers) assume one query row per key row
    # written to their paged cache; the aux rows break that (dualflow-transformers has a vLLM model).
    _supports_attention_backend = False
    # The recorders take the router logits over the stacked rows and each attention call's (primary, aux)
    # weights (`split_recorded_flows` splits them). Hidden states are recorded by the layer loop: each flow's
    # rows must be tensors of the graph (`record_flows`), which rows cut from a hooked layer output are not.
    _can_record_outputs = {
        "router_logits": OutputRecorder(DualFlowRouter, index=0),
        "attentions": OutputRecorder(DualFlowAttention, index=1),
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers looks for its experts decorator in the model's file; Qwen3-MoE's file decorates ours
        return True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # Qwen3-MoE's, experts and router included
        if isinstance(module, DualFlowGain):
            init.constant_(module.weight, module.init_value)
        elif module is getattr(self, "aux_embed_tokens", None) and self.config.aux_embed_init == "copy":
            # `self` is the DualFlowModel here; its primary embedding, registered first, is initialised
            init.copy_(module.weight, self.embed_tokens.weight)
        elif isinstance(module, DualFlowAuxAdapter):
            init.normal_(module.down, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.up)


class DualFlowModel(DualFlowPreTrainedModel):
    def __init__(self, config: DualFlowConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.aux_embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DualFlowDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False

        # Initialize weights and apply final processing
        self.post_init()

    def get_aux_input_embeddings(self) -> nn.Embedding:
        return self.aux_embed_tokens

    def _check_inputs(self, input_ids, inputs_embeds, aux_inputs_embeds, attention_mask, past_length):
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            shape = tuple(input_ids.shape)
        else:
            shape = tuple(inputs_embeds.shape[:-1])
        if len(shape) != 2 or 0 in shape:
            raise ValueError(
                f"input_ids must have shape (batch, sequence_length), at least one token, got {shape}"
            )
        if aux_inputs_embeds is not None and tuple(aux_inputs_embeds.shape[:-1]) != shape:
            raise ValueError(
                f"aux_inputs_embeds has shape {tuple(aux_inputs_embeds.shape)}, expected {(*shape, 'hidden')}"
            )
        # Only where reading the ids is free: on an accelerator `.tolist()` would stall every decode step on a
        # device-to-host copy (and the embedding lookup raises its own error there); compiled, it would break
        # the graph.
        if input_ids is not None and input_ids.device.type == "cpu" and not is_torchdynamo_compiling():
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"input_ids contain token id {bad} outside the vocabulary [0, {self.vocab_size})"
                )
        # `generate` may hand a prepared mask (a flex BlockMask with a static cache): a 2-D one is checked
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            expected = (shape[0], past_length + shape[1])
            if attention_mask.shape != expected:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, "
                    f"expected {expected} (batch, past + new)"
                )

    def _aux_settings(
        self, aux_num_experts_per_tok: int | None, aux_num_rounds: int | None
    ) -> tuple[int, int]:
        """This call's aux top-k and number of aux rounds, checked."""
        aux_top_k = aux_num_experts_per_tok
        if aux_top_k is None:
            aux_top_k = self.config.aux_num_experts_per_tok
        num_rounds = aux_num_rounds
        if num_rounds is None:
            num_rounds = self.config.aux_num_rounds
        self.config.check_aux_settings(aux_top_k, num_rounds)
        if num_rounds > 1 and self.config.aux_num_rounds == 1:
            raise ValueError(
                "aux_num_rounds > 1 needs a model built with aux_num_rounds > 1 "
                "(`dualflow convert --aux-rounds`)"
            )
        return aux_top_k, num_rounds

    def _stack_aux_rows(
        self,
        input_ids,
        inputs_embeds,
        aux_inputs_embeds,
        aux_positions,
        position_ids,
        masks,
        cache,
        past_length,
    ):
        """
        The rows `[primary; aux]`, their positions, the aux positions as indices, and the masks. The aux rows
        get a mask of their own where they are not at every primary position: they then attend in a call of
        their own.
        """
        num_primary = inputs_embeds.shape[1]
        last_positions = not isinstance(aux_positions, torch.Tensor)
        aux_positions, at_every_position = positions_to_keep(aux_positions, num_primary, inputs_embeds.device)
        if aux_inputs_embeds is not None:
            aux_embeds = aux_inputs_embeds[:, aux_positions]
        elif input_ids is not None:
            aux_embeds = self.aux_embed_tokens(input_ids[:, aux_positions])
        else:  # no ids to look up: start from the given rows (exact at the upcycling init, E_aux == E)
            aux_embeds = inputs_embeds[:, aux_positions]
        # `.to`: a device_map may put the two embedding tables on different devices
        hidden_states = torch.cat([inputs_embeds, aux_embeds.to(inputs_embeds.device)], dim=1)
        row_positions = torch.cat([position_ids, position_ids[:, aux_positions]], dim=1)
        if not at_every_position:
            kv_length = num_primary
            if isinstance(cache, Cache):
                kv_length = cache.get_mask_sizes(num_primary, 0)[0]
            aux_mask, aux_is_causal = aux_rows_mask(
                self.config,
                masks.primary.mask,
                aux_positions,
                last_positions,
                num_primary,
                past_length,
                kv_length,
            )
            aux = FlowMask(mask=aux_mask, is_causal=aux_is_causal, position_ids=None)
            masks = DualFlowMasks(primary=masks.primary, aux=aux)
        return hidden_states, row_positions, aux_positions, masks

    @can_return_tuple
    @split_recorded_flows
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        aux_positions: int | torch.LongTensor | None = None,
        aux_inputs_embeds: torch.FloatTensor | None = None,
        aux_num_experts_per_tok: int | None = None,
        aux_num_rounds: int | None = None,
        output_hidden_states: bool | int | list[int] | None = None,
        output_attentions: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DualFlowModelOutputWithPast:
        r"""
        aux_positions (`int` or `torch.LongTensor` of shape `(num_aux_positions,)`, *optional*):
            Where the auxiliary flow runs, read like `logits_to_keep`: 0 every position, an int k the last k,
            a tensor those sequence indices; `None` runs the primary flow only.
        aux_inputs_embeds, aux_num_experts_per_tok, aux_num_rounds, cache:
            As for `DualFlowForCausalLM.forward`.
        """
        cache = past_key_values if cache is None else cache
        past_length = cache.get_seq_length() if isinstance(cache, Cache) else 0
        self._check_inputs(input_ids, inputs_embeds, aux_inputs_embeds, attention_mask, past_length)
        aux_top_k, num_rounds = self._aux_settings(aux_num_experts_per_tok, aux_num_rounds)
        if use_cache and cache is None:
            cache = DualFlowCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        num_primary = inputs_embeds.shape[1]
        if position_ids is None:
            position_ids = torch.arange(num_primary, device=inputs_embeds.device).unsqueeze(0) + past_length

        mask_function = (
            create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
        )
        # the cache by position: its keyword's name depends on the version (CACHE_FIELD)
        primary_mask = mask_function(
            self.config, inputs_embeds, attention_mask, cache, position_ids=position_ids
        )
        # `is_causal` (continuous batching passes it with its mask) is the primary rows'; aux rows have theirs
        primary = FlowMask(
            mask=primary_mask, is_causal=kwargs.pop("is_causal", None), position_ids=position_ids
        )
        masks = DualFlowMasks(primary=primary)

        hidden_states = inputs_embeds
        row_positions = position_ids
        if aux_positions is not None:
            hidden_states, row_positions, aux_positions, masks = self._stack_aux_rows(
                input_ids,
                inputs_embeds,
                aux_inputs_embeds,
                aux_positions,
                position_ids,
                masks,
                cache,
                past_length,
            )
        position_embeddings = self.rotary_emb(hidden_states, position_ids=row_positions)
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        selected, input_state_returned = hidden_states_to_return(output_hidden_states, len(self.layers))
        # The extra aux rounds get the cache too, and leave it alone: they read the first round's keys/values.
        layer_kwargs = dict(
            masks=masks, position_embeddings=position_embeddings, aux_top_k=aux_top_k, **kwargs
        )
        layer_kwargs[CACHE_FIELD] = cache

        all_hidden_states = []
        layer_states = []  # what the extra aux rounds read: each layer's coupled state and keys/values
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            if selected is not None:
                hidden_states = record_flows(hidden_states, num_primary, all_hidden_states)
            coupled_state = None
            if aux_positions is not None:
                coupled_state = hidden_states[:, aux_positions]
            hidden_states, keys, values = decoder_layer(
                hidden_states,
                coupled_state,
                num_primary=num_primary,
                output_attentions=output_attentions,
                **layer_kwargs,
            )
            if aux_positions is not None and num_rounds > 1:
                layer_states.append((coupled_state, keys, values))
        if layer_states:
            hidden_states = self._extra_aux_rounds(
                hidden_states, num_primary, layer_states, num_rounds - 1, layer_kwargs
            )

        hidden_states = self.norm(hidden_states)
        last_hidden_state = hidden_states[:, :num_primary]
        aux_last_hidden_state = None
        if aux_positions is not None:
            aux_last_hidden_state = hidden_states[:, num_primary:]
        all_hidden_states.append((last_hidden_state, aux_last_hidden_state))
        hidden_states, aux_hidden_states = returned_hidden_states(
            all_hidden_states, selected, input_state_returned
        )
        return with_cache(
            DualFlowModelOutputWithPast,
            cache,
            last_hidden_state=last_hidden_state,
            hidden_states=hidden_states,
            aux_last_hidden_state=aux_last_hidden_state,
            aux_hidden_states=aux_hidden_states if aux_positions is not None else None,
        )

    def _extra_aux_rounds(self, hidden_states, num_primary, layer_states, rounds, layer_kwargs):
        """The aux rows alone through the layers `rounds` times more, with the first round's keys/values."""
        cos, sin = layer_kwargs["position_embeddings"]
        layer_kwargs = {**layer_kwargs, "position_embeddings": (cos[:, num_primary:], sin[:, num_primary:])}
        aux_states = hidden_states[:, num_primary:]
        for _ in range(rounds):
            for decoder_layer, layer_state in zip(self.layers, layer_states):
                aux_states = decoder_layer(aux_states, *layer_state, num_primary=0, **layer_kwargs)[0]
        return torch.cat([hidden_states[:, :num_primary], aux_states], dim=1)


def positions_to_keep(
    logits_to_keep: int | torch.Tensor, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """
    The indices `logits_to_keep` selects (0 all, an int k the last k, a tensor those indices), where the aux
    flow runs and both flows' logits are taken; and whether they are every position, in order.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        positions = logits_to_keep.to(device=device, dtype=torch.long).reshape(-1)
        positions = torch.where(positions < 0, positions + seq_len, positions)
        # Checked only where reading it is free, as the ids are: on an accelerator it would stall the step
        # on a device-to-host copy (continuous batching passes a tensor each step); compiled, it would break
        # the graph.
        if positions.numel() and positions.device.type == "cpu" and not is_torchdynamo_compiling():
            low, high = torch.stack(torch.aminmax(positions)).tolist()
            if low < 0 or high >= seq_len:
                raise ValueError(f"logits_to_keep holds indices outside [0, {seq_len})")
        return positions, False  # a tensor may reorder or repeat positions
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
    keep = seq_len if logits_to_keep == 0 else min(logits_to_keep, seq_len)
    return torch.arange(seq_len - keep, seq_len, device=device), keep == seq_len


class DualFlowForCausalLM(DualFlowPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _fsdp_plan = {"lm_head": "keep_full_weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DualFlowConfig):
        super().__init__(config)
        self.model = DualFlowModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        # Initialize weights and apply final processing
        self.post_init()

    def aux_parameter_names(self) -> list[str]:
        """The aux flow's own parameters (modules named `aux_*`): embedding, couplings, gates, adapters."""
        return [
            name
            for name, _ in self.named_parameters()
            if any(part.startswith("aux_") for part in name.split("."))
        ]

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        # The aux embedding follows the primary one by transformers' own rule, as Gemma 3n's extra table does.
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        aux = self.model.aux_embed_tokens
        self.model.aux_embed_tokens = self._get_resized_embeddings(
            aux, embeddings.num_embeddings, None, mean_resizing
        )
        self.model.aux_embed_tokens.requires_grad_(aux.weight.requires_grad)
        self.model.vocab_size = self.config.vocab_size
        return embeddings

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # The hook in-tree models (t5gemma) override to choose their cache. A given cache (the base model's
        # prefill, say) of other shapes is refused. transformers has no hook for the class of the cache it
        # builds: where it built a DynamicCache, a DualFlowCache built with the same arguments takes its
        # place.
        given = model_kwargs.get("cache")
        if given is None:
            given = model_kwargs.get("past_key_values")
        if isinstance(given, Cache):
            check_cache_shapes(given, self.config, self.tp_size)
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        built = model_kwargs.get(CACHE_FIELD)
        if given is None and type(built) is DynamicCache:
            cache = DualFlowCache(
                config=self.config.get_text_config(decoder=True), offloading=built.offloading
            )
            # as transformers does for an assistant's cache (the argument 5.25 adds concerns linear-attention
            # layers)
            if generation_config.is_assistant:
                cache.activate_past_recording()
            model_kwargs[CACHE_FIELD] = cache

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, aux_inputs_embeds=None, **kwargs):
        model_inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
        # Like `inputs_embeds`, `aux_inputs_embeds` covers the prompt: it is used where the prompt's
        # embeddings are.
        prompt_embeds = model_inputs.get("inputs_embeds")
        if aux_inputs_embeds is not None and prompt_embeds is not None:
            model_inputs["aux_inputs_embeds"] = aux_inputs_embeds[:, -prompt_embeds.shape[1] :]
        # `generate` reads the predicted logits only: the primary rows' LM head is skipped unless asked for.
        model_inputs.setdefault("return_primary_logits", False)
        return model_inputs

    def init_continuous_batching(self, *args, **kwargs):
        # Continuous batching (`generate_batch`, `transformers serve`) packs a step's requests into one row;
        # the aux rows, one per request that samples, attend with their positions' rows of the mask that sdpa
        # and eager get. Flash takes no mask (and the manager switches half-precision models to it): refused
        # before any request.
        attn_implementation = self.config._attn_implementation
        manager = super().init_continuous_batching(*args, **kwargs)
        if is_flash_attention_requested(self.config):
            if (
                self.config._attn_implementation != attn_implementation
            ):  # the manager switched it: switch it back
                self.set_attn_implementation(attn_implementation)
            raise ValueError(
                'continuous batching runs a Dual-Flow model with attn_implementation "sdpa" or "eager", '
                "not flash attention: set one and pass ContinuousBatchingConfig(auto_switch_to_flash=False), "
                "or use generate()"
            )
        return manager

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        use_aux_flow: bool | None = None,
        aux_inputs_embeds: torch.FloatTensor | None = None,
        aux_num_experts_per_tok: int | None = None,
        aux_num_rounds: int | None = None,
        return_primary_logits: bool = True,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DualFlowCausalLMOutputWithPast:
        r"""
        use_aux_flow (`bool`, *optional*):
            Run the auxiliary flow at the positions selected by `logits_to_keep` and predict with it; defaults
            to `config.use_aux_flow`. The primary flow, its logits and the cache are the same either way.
        aux_inputs_embeds (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`,
        *optional*):
            Where the aux flow starts. The aux row of a position starts from `aux_inputs_embeds` when given,
            else from the aux embedding of its id, else (no ids: `inputs_embeds` only) from its
            `inputs_embeds` row.
        aux_num_experts_per_tok (`int`, *optional*):
            Aux-flow expert top-k for this call (trade decode cost for quality without reconverting); MoE
            models only.
        aux_num_rounds (`int`, *optional*):
            Passes of the aux flow through the layers for this call; defaults to `config.aux_num_rounds`.
            Values above 1 need a model built with `aux_num_rounds` > 1 (it holds the round gates).
        return_primary_logits (`bool`, *optional*, defaults to `True`):
            Compute `primary_logits` when the aux flow runs (always with `labels`: the loss needs them).
            `generate` passes `False` unless given `return_primary_logits=True`: decoding skips an LM head
            nobody reads.
        cache (`Cache`, *optional*):
            `past_key_values` under the name transformers uses from 5.24 on (either works).
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        if use_aux_flow is None:
            use_aux_flow = self.config.use_aux_flow
        if not isinstance(use_aux_flow, bool):  # a string such as "no" would count as True
            raise TypeError(f"use_aux_flow must be True or False, got {use_aux_flow!r}")
        # `shape[-1]`, `shape[-2]`: a wrongly shaped input reaches the model's own one-line check, not an
        # IndexError
        if input_ids is not None:
            seq_len, device = input_ids.shape[-1], input_ids.device
        else:
            seq_len, device = inputs_embeds.shape[-2], inputs_embeds.device
        keep_positions, keep_all = positions_to_keep(logits_to_keep, seq_len, device)

        outputs: DualFlowModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values if cache is None else cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            aux_positions=logits_to_keep if use_aux_flow else None,
            aux_inputs_embeds=aux_inputs_embeds,
            aux_num_experts_per_tok=aux_num_experts_per_tok,
            aux_num_rounds=aux_num_rounds,
            **kwargs,
        )

        primary_rows = outputs.last_hidden_state
        if not keep_all:  # `.to`: under a device_map the last layer may sit on another device than the inputs
            primary_rows = primary_rows[:, keep_positions.to(primary_rows.device)]
        primary_logits = None
        if return_primary_logits or labels is not None or not use_aux_flow:
            primary_logits = self.lm_head(primary_rows)
        logits = primary_logits
        if use_aux_flow:
            logits = self.lm_head(outputs.aux_last_hidden_state)

        loss = None
        if labels is not None:
            if not keep_all:
                raise ValueError("labels need logits at every position: leave logits_to_keep at 0")
            # CE(aux) + primary_loss_weight * CE(primary) with the aux flow on, CE(primary) with it off
            loss = self.loss_function(primary_logits, labels, self.vocab_size, **kwargs)
            if use_aux_flow:
                aux_ce = self.loss_function(logits, labels, self.vocab_size, **kwargs)
                loss = aux_ce + self.config.primary_loss_weight * loss
        aux_loss = None
        if output_router_logits and outputs.router_logits:
            aux_loss = self._router_balance_loss(
                outputs, attention_mask, seq_len, keep_positions, aux_num_experts_per_tok
            )
            if loss is not None:
                balance_term = self.config.router_aux_loss_coef * aux_loss.to(loss.device)
                if kwargs.get("num_items_in_batch") is not None:
                    # With `num_items_in_batch` (Trainer's gradient accumulation) the CE terms are divided by
                    # the whole accumulated batch and Trainer no longer divides by the steps: weigh this
                    # micro-batch's balance loss by its share of the label tokens, or it would count once per
                    # accumulation step.
                    balance_term = (
                        balance_term * (labels[..., 1:] != -100).sum() / kwargs["num_items_in_batch"]
                    )
                loss = loss + balance_term

        return with_cache(
            DualFlowCausalLMOutputWithPast,
            getattr(outputs, CACHE_FIELD),
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            primary_logits=primary_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            aux_hidden_states=outputs.aux_hidden_states,
            aux_attentions=outputs.aux_attentions,
            aux_router_logits=outputs.aux_router_logits,
        )

    def _router_balance_loss(self, outputs, attention_mask, seq_len, keep_positions, aux_top_k):
        """`aux_loss`: transformers' Switch-style loss of each flow (its rows, its top-k), padding out."""
        # A 2-D mask covers past + new tokens; its last seq_len columns are this call's positions.
        mask = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            mask = attention_mask[:, -seq_len:]
        num_experts = self.config.num_experts
        loss = load_balancing_loss_func(
            outputs.router_logits, num_experts, self.config.num_experts_per_tok, mask
        )
        if outputs.aux_router_logits is not None:
            aux_top_k = aux_top_k or self.config.aux_num_experts_per_tok
            aux_mask = mask[:, keep_positions] if mask is not None else None
            loss = loss + load_balancing_loss_func(
                outputs.aux_router_logits, num_experts, aux_top_k, aux_mask
            )
        return loss


__all__ = ["DualFlowPreTrainedModel", "DualFlowModel", "DualFlowForCausalLM"]
