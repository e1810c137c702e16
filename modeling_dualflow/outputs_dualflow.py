"""What a Dual-Flow model returns: its output classes, and each flow's hidden states in the graph."""

from dataclasses import dataclass
from functools import wraps

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import output_capturing


# The differences within the supported transformers range (5.19 up to 6), all in one place.  5.24 renamed the
# cache keyword and output field `past_key_values` to `cache`. `generate` passes and reads the name of the
# installed version, and 5.24 still takes the old one with a deprecation warning. So the forwards take both
# keywords (`cache` wins), outputs are built with `with_cache`, `_skip_keys_device_placement` (and the
# config's `keys_to_ignore_at_inference`) name both, and `create_causal_mask` gets the cache by position. The
# decoder layers get it under CACHE_FIELD too: the name under which `GradientCheckpointingLayer` takes it from
# a checkpointed layer.
CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"

# 5.24 (`resolve_hidden_states_indices`) reads an `output_hidden_states` selection as positions among all
# states (the input state first, negative ones from the end, an int for one); 5.19-5.23 read a list of
# positions among the layers' outputs (no input state; anything else is a flag). The model selects as
# Qwen3-MoE does.
SELECTS_AMONG_ALL_STATES = hasattr(output_capturing, "resolve_hidden_states_indices")


def with_cache(output_class, cache, **fields):
    """`output_class(**fields)` with `cache` under the installed version's field name (`CACHE_FIELD`)."""
    fields[CACHE_FIELD] = cache
    return output_class(**fields)


def hidden_states_to_return(output_hidden_states, num_layers: int) -> tuple[set[int] | None, bool]:
    """
    The states `output_hidden_states` asks for, as positions 0..num_layers (0 is the input state, i the output
    of layer i - 1), or None for none; and whether the returned tuple has an entry for the input state.
    """
    num_states = num_layers + 1
    is_flag = isinstance(output_hidden_states, (bool, type(None)))
    if SELECTS_AMONG_ALL_STATES and not is_flag:
        indices = output_hidden_states
        if isinstance(indices, int):
            indices = [indices]
        return {index % num_states for index in indices if -num_states <= index < num_states}, True
    if isinstance(output_hidden_states, (list, tuple, set)):
        return {index + 1 for index in output_hidden_states if 0 <= index < num_layers}, False
    if not output_hidden_states:
        return None, True
    return set(range(num_states)), True


@dataclass
class DualFlowModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    last_hidden_state, hidden_states, attentions, router_logits, cache (`past_key_values` before transformers
    5.24):
        The primary flow's, exactly as a Qwen3-MoE model of the same config returns them (`hidden_states[-1]`
        is the final-normed state; `router_logits` is `None` for a dense model).
    aux_last_hidden_state (`torch.FloatTensor` of shape `(batch_size, num_aux_positions, hidden_size)`,
    *optional*):
        Final-normed auxiliary flow states at `aux_positions`; `None` when the aux flow did not run.
    aux_hidden_states, aux_attentions, aux_router_logits (*optional*):
        The same per-layer outputs for the aux rows: states `(batch, P, hidden)`, attentions
        `(batch, heads, P, keys)`, router logits `(batch * P, num_experts)`.
    """

    aux_last_hidden_state: torch.FloatTensor | None = None
    aux_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_attentions: tuple[torch.FloatTensor, ...] | None = None
    aux_router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DualFlowCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    logits (`torch.FloatTensor`):
        The prediction: aux flow logits when the aux flow is on, primary logits when it is off.
    primary_logits (`torch.FloatTensor`):
        Primary flow logits at the same positions; `None` where the aux flow ran with
        `return_primary_logits=False` (what `generate` passes unless asked for them).
    aux_loss (`torch.FloatTensor`, *optional*):
        The router load-balancing loss: each flow's Switch-style loss over its own rows and top-k, summed,
        padding left out. Returned when `output_router_logits` is on (MoE models only).
    hidden_states, attentions, router_logits, aux_hidden_states, aux_attentions, aux_router_logits
    (*optional*):
        As in `DualFlowModelOutputWithPast`.
    """

    primary_logits: torch.FloatTensor | None = None
    aux_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_attentions: tuple[torch.FloatTensor, ...] | None = None
    aux_router_logits: tuple[torch.FloatTensor, ...] | None = None


def record_flows(states: torch.Tensor, num_primary: int, recorded: list) -> torch.Tensor:
    """
    Appends the (primary, aux) rows of `states` to `recorded` as tensors of the graph, so that `retain_grad`
    on them gets a gradient: the layers go on from their concatenation, which is returned.
    """
    if states.shape[1] == num_primary:  # no aux rows
        recorded.append((states, None))
        return states
    recorded.append(states.split([num_primary, states.shape[1] - num_primary], dim=1))
    return torch.cat(recorded[-1], dim=1)


def flows_of(per_layer: list) -> tuple[tuple, tuple]:
    """Per-layer (primary, aux) pairs as a tuple of each flow's entries."""
    return tuple(entry[0] for entry in per_layer), tuple(entry[1] for entry in per_layer)


def returned_hidden_states(recorded: list, selected: set[int] | None, input_state_returned: bool):
    """
    Each flow's hidden states among those `record_flows` recorded entering the layers, then (as in
    transformers' language models) the final-normed ones: those `selected`, the others None; (None, None) when
    none were asked.
    """
    if selected is None:
        return None, None
    recorded = [states if index in selected else (None, None) for index, states in enumerate(recorded)]
    first = 0 if input_state_returned else 1
    return flows_of(recorded[first:])


def split_recorded_flows(forward):
    """
    Wraps the base model's `forward` outside `capture_outputs`, whose recorders see both flows in each call
    (attentions as (primary, aux) weights, router logits over the stacked rows): each flow gets its own.
    """

    @wraps(forward)
    def wrapper(self, *args, **kwargs):
        outputs = forward(self, *args, **{**kwargs, "return_dict": True})
        ran_aux = outputs.aux_last_hidden_state is not None
        # `or None`: a dense model returns no router logits, as transformers' MoE models do
        flows = dict(attentions=None, aux_attentions=None, router_logits=outputs.router_logits or None)
        if outputs.attentions is not None:
            primary_attentions, aux_attentions = flows_of(outputs.attentions[: self.config.num_hidden_layers])
            flows["attentions"] = primary_attentions
            if ran_aux:
                flows["aux_attentions"] = aux_attentions
        if outputs.router_logits and ran_aux:
            batch_size, num_primary = outputs.last_hidden_state.shape[:2]
            num_routed = sum(layer.routes_flows for layer in self.layers)
            per_row = [logits.unflatten(0, (batch_size, -1)) for logits in outputs.router_logits[:num_routed]]
            flows["router_logits"] = tuple(rows[:, :num_primary].flatten(0, 1) for rows in per_row)
            flows["aux_router_logits"] = tuple(rows[:, num_primary:].flatten(0, 1) for rows in per_row)
        return type(outputs)(**{**outputs, **flows})

    return wrapper
