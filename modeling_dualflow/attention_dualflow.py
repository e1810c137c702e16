"""Attention of a Dual-Flow layer: the queries of both flows against the keys/values of the primary rows."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, eager_attention_forward, rotate_half
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import is_flash_attention_requested


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, rows, head_dim); cos/sin: (batch, rows, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DualFlowAuxAdapter(nn.Module):
    """
    A low-rank delta `up(down(x))` the aux rows alone add to a shared weight's output; `up` starts at 0. Under
    tensor parallelism it is split as the weight it adapts is (the config's `base_model_tp_plan`).
    """

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        # read by transformers' `colwise` / `rowwise` styles, as on an `nn.Linear`
        self.in_features = in_features
        self.out_features = out_features
        self.down = nn.Parameter(torch.empty(rank, in_features))
        self.up = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.down), self.up)


def add_to_aux_rows(
    output: torch.Tensor, inputs: torch.Tensor, adapter: DualFlowAuxAdapter | None, num_primary: int
) -> torch.Tensor:
    """
    `output` (batch, rows, out) with `adapter(inputs)` added to its aux rows (those from `num_primary` on);
    the primary rows are left as they are.
    """
    if adapter is None or output.shape[1] == num_primary:
        return output
    # contiguous: under tensor parallelism these rows become a DTensor, and its linear views them, which a
    # slice across the batch does not allow
    aux_output = output[:, num_primary:] + adapter(inputs[:, num_primary:].contiguous())
    if num_primary == 0:
        return aux_output
    return torch.cat([output[:, :num_primary], aux_output], dim=1)


class FlowMask(NamedTuple):
    """What one flow's rows attend with: the attention function's mask, `is_causal` and `position_ids`."""

    mask: torch.Tensor | BlockMask | None
    is_causal: bool | None
    position_ids: torch.Tensor | None


class DualFlowMasks(NamedTuple):
    """
    Each flow's `FlowMask`. `aux` is None where the aux rows sit at the primary positions (training, scoring,
    decode): they then attend as extra query heads in the primary rows' call, with the primary mask.
    """

    primary: FlowMask
    aux: FlowMask | None = None


def aux_rows_mask(
    config, primary_mask, aux_positions, last_positions, num_primary, past_length, kv_length
) -> tuple[torch.Tensor | BlockMask | None, bool | None]:
    """
    The mask and `is_causal` of aux rows that are not at every primary position: each row gets its position's
    row of the primary mask, in the backend's form. `last_positions`: the rows are the last P positions, in
    order.
    """
    num_aux = aux_positions.shape[0]
    if isinstance(primary_mask, BlockMask):
        # flex: the primary mask function, its query index mapped to the aux rows' positions
        def aux_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
            return primary_mask.mask_mod(batch_idx, head_idx, aux_positions[q_idx], kv_idx)

        batch_size = primary_mask.kv_num_blocks.shape[0]
        kv_length = primary_mask.seq_lengths[1]
        block_mask = create_block_mask(
            aux_mask_mod, batch_size, None, num_aux, kv_length, aux_positions.device
        )
        return block_mask, None
    if is_flash_attention_requested(config):
        # flash takes a 2-D padding mask (or none) and aligns causal attention bottom-right: exactly the mask
        # rows of the last P positions; other positions have no such form.
        if not last_positions:
            raise ValueError(
                "flash attention runs the aux flow at the last k positions: pass logits_to_keep as an int, "
                'or use attn_implementation="sdpa", "eager" or "flex_attention" for a tensor of positions'
            )
        return primary_mask, True
    if primary_mask is not None:  # eager / sdpa: the (batch, 1, P, keys) rows of the dense mask
        return primary_mask[:, :, aux_positions], None
    # sdpa skipped the mask: causal, no padding, no window in reach. kv_length > past + T for a static cache:
    # its empty slots must stay masked.
    if last_positions and num_aux == 1 and kv_length == past_length + num_primary:
        return None, False  # the last position sees every key
    key_positions = torch.arange(kv_length, device=aux_positions.device)
    mask = key_positions[None, :] <= (aux_positions + past_length)[:, None]
    return mask[None, None], None


class DualFlowQueryHeadGroups(nn.Module):
    """
    What eager, sdpa and flex read in the both-flows call: each key/value head has its primary query heads,
    then as many aux heads, so the group (eager and sdpa read it for `repeat_kv`) is twice the layer's.
    """

    def __init__(self, config, layer_idx: int, num_key_value_groups: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = True


class DualFlowAttention(nn.Module):
    """Self-attention with queries from [primary rows; aux rows], keys/values from the primary rows only."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window
        # both flows in one call: per key/value head its primary query heads, then as many aux heads
        self.both_flows_heads = DualFlowQueryHeadGroups(config, layer_idx, 2 * self.num_key_value_groups)
        q_dim = config.num_attention_heads * self.head_dim
        kv_dim = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.attention_bias)
        # Qwen3 normalises each head, OLMoE the whole projection (as one group of heads), the others neither.
        self.q_norm = self.k_norm = None
        if config.qk_norm == "per_head":
            self.norm_groups = (-1, self.head_dim)
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        elif config.qk_norm == "full":
            self.norm_groups = (1, -1)
            self.q_norm = LlamaRMSNorm(q_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(kv_dim, eps=config.rms_norm_eps)
        self.aux_q_adapter = self.aux_o_adapter = None
        if config.aux_adapter_rank:
            self.aux_q_adapter = DualFlowAuxAdapter(config.hidden_size, q_dim, config.aux_adapter_rank)
            self.aux_o_adapter = DualFlowAuxAdapter(q_dim, config.hidden_size, config.aux_adapter_rank)

    def _project(self, hidden_states, proj, norm, num_primary=0, aux_adapter=None):
        """
        (batch, rows, hidden) -> (batch, heads, rows, head_dim): projected (plus the aux rows' adapter delta),
        q/k-normed, then clipped, in OLMoE's order.
        """
        rows = hidden_states.shape[:-1]
        states = add_to_aux_rows(proj(hidden_states), hidden_states, aux_adapter, num_primary)
        if norm is not None:
            states = norm(states.view(*rows, *self.norm_groups))
        if self.config.clip_qkv is not None:
            states = states.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        return states.view(*rows, -1, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        num_primary: int,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        masks: DualFlowMasks,
        cache: Cache | None = None,
        primary_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, tuple, tuple[torch.Tensor, torch.Tensor]]:
        """
        hidden_states: (batch, T + P, hidden), normed. With `primary_key_values` (an extra aux round: aux rows
        only, num_primary = 0) the rows attend to those keys/values; nothing is projected or cached.

        Returns the output, the (primary, aux) attention weights (None unless `output_attentions` and the
        backend gives them), and the keys/values used.
        """
        cos, sin = position_embeddings
        query_states = self._project(hidden_states, self.q_proj, self.q_norm, num_primary, self.aux_q_adapter)
        query_states = apply_rotary(query_states, cos, sin)
        if primary_key_values is None:
            primary = hidden_states[:, :num_primary]
            key_states = self._project(primary, self.k_proj, self.k_norm)
            key_states = apply_rotary(key_states, cos[:, :num_primary], sin[:, :num_primary])
            value_states = self._project(primary, self.v_proj, None)
            if cache is not None:
                # `kwargs`: continuous batching's paged cache reads its indices there
                key_states, value_states = cache.update(
                    key_states, value_states, self.layer_idx, kwargs=kwargs
                )
        else:
            key_states, value_states = primary_key_values
        # The cache is updated above, as transformers' models do from 5.24 on (before, the `paged|eager`
        # function updated a paged cache itself). Both flows attend to the keys read back, so `paged|eager` is
        # eager here.
        implementation = self.config._attn_implementation.removeprefix("paged|")
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)

        def attend(module, query, flow_mask: FlowMask):
            return attention_interface(
                module,
                query,
                key_states,
                value_states,
                flow_mask.mask,
                dropout=self.attention_dropout if self.training else 0.0,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                is_causal=flow_mask.is_causal,
                position_ids=flow_mask.position_ids,
                **kwargs,
            )

        aux_mask = masks.aux or masks.primary
        primary_weights = aux_weights = None
        if num_primary == hidden_states.shape[1]:  # primary rows only
            attn_output, primary_weights = attend(self, query_states, masks.primary)
        elif num_primary == 0:  # aux rows only: an extra aux round
            attn_output, aux_weights = attend(self, query_states, aux_mask)
        elif masks.aux is None and not output_attentions:
            attn_output = self._attend_as_query_heads(attend, query_states, num_primary, masks.primary)
        else:
            # A call per flow; asked for weights, each flow's are the tensors its output was computed from.
            primary_output, primary_weights = attend(self, query_states[:, :, :num_primary], masks.primary)
            aux_output, aux_weights = attend(self, query_states[:, :, num_primary:], aux_mask)
            attn_output = torch.cat([primary_output, aux_output], dim=1)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        attn_output = add_to_aux_rows(self.o_proj(attn_output), attn_output, self.aux_o_adapter, num_primary)
        # the model's output recorder takes the (primary, aux) weights where the backend gave any
        attn_weights = None
        if primary_weights is not None or aux_weights is not None:
            attn_weights = (primary_weights, aux_weights)
        return attn_output, attn_weights, (key_states, value_states)

    def _attend_as_query_heads(self, attend, query_states, num_primary, flow_mask: FlowMask):
        """
        Aux rows at the primary positions: one call in which each key/value head gets its aux heads after its
        primary ones, so that the GQA head order of every backend (head h reads key/value head h // group)
        holds.
        """
        batch, num_heads, _, head_dim = query_states.shape
        group = self.num_key_value_groups
        num_kv_heads = num_heads // group
        # (batch, heads, 2T, d) -> (batch, 2 * heads, T, d)
        query_states = query_states.reshape(batch, num_kv_heads, group, 2, num_primary, head_dim)
        query_states = query_states.transpose(2, 3).reshape(batch, 2 * num_heads, num_primary, head_dim)
        # flash kernels group heads by the shapes, and flash reads its dtype from this layer's weights
        heads = self if is_flash_attention_requested(self.config) else self.both_flows_heads
        attn_output, _ = attend(heads, query_states, flow_mask)
        # (batch, T, 2 * heads, d) -> (batch, 2T, heads, d): back to [primary rows; aux rows]
        attn_output = attn_output.reshape(batch, num_primary, num_kv_heads, 2, group, head_dim)
        return attn_output.permute(0, 3, 1, 2, 4, 5)
