"""Slow, obviously-correct two-pass Dual-Flow reference (docs/design.md §7.4).

Pass 1 runs the primary flow alone (filling the cache); pass 2 walks the aux flow through the layers one row at a
time with explicit loops: masks built from positions, experts applied one by one from the fused weights. Test code
only: the tests check the grouped execution against it. It is deliberately slow and never timed: the two-pass baseline
that `dualflow compare` and the benchmarks time is `dualflow/instruments/two_pass.py`.
"""

import torch
import torch.nn.functional as F

from modeling_dualflow.attention_dualflow import apply_rotary
from modeling_dualflow.modeling_dualflow import DualFlowSparseMoeBlock


def _expert(experts, index, x):
    gate, up = F.linear(x, experts.gate_up_proj[index]).chunk(2, dim=-1)
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[index])


def _moe_row(block, x, top_k):
    # x: (hidden,) one aux row
    probs = F.softmax(F.linear(x, block.gate.weight).float(), dim=-1)
    weights, indices = torch.topk(probs, top_k)
    if block.gate.norm_topk_prob:
        weights = weights / weights.sum()
    out = sum(w.to(x.dtype) * _expert(block.experts, int(i), x) for w, i in zip(weights, indices))
    if block.shared_expert is not None:
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


def plus_adapter(projection, owner, adapter_name):
    """`projection`, plus the aux adapter `owner.<adapter_name>` on the same input where the model has one."""
    adapter = getattr(owner, adapter_name, None)
    return projection if adapter is None else lambda x: projection(x) + adapter(x)


@torch.no_grad()
def aux_pass(
    model,
    input_ids,
    entering_states,
    cache,
    aux_positions,
    position_ids,
    attention_mask=None,
    aux_top_k=None,
    num_rounds=None,
):
    """
    Run the aux flow after the primary pass. `entering_states[l]`: (batch, T, hidden) primary state entering layer l;
    `cache` holds the primary K/V including the T new tokens (every key the aux rows may attend to: use a plain
    `DynamicCache()`, not a sliding-window one that drops keys within the chunk); `position_ids`: (batch, T);
    `attention_mask`: (batch, past + T) or None. Aux adapters (`aux_adapter_rank`) add their low-rank deltas to q_proj,
    o_proj and the MLP output. Each of the `num_rounds` rounds walks every layer; in rounds after the
    first, a layer's whole update is scaled by its round gate. Returns aux logits (batch, P, vocab).
    """
    config = model.config
    aux_top_k = aux_top_k or config.aux_num_experts_per_tok
    num_rounds = num_rounds or config.aux_num_rounds
    body = model.model
    batch, num_new = input_ids.shape
    past = cache.get_seq_length() - num_new
    aux_states = body.aux_embed_tokens(input_ids[:, aux_positions])
    positions = position_ids[:, aux_positions].expand(batch, -1)
    cos, sin = body.rotary_emb(aux_states, positions)

    def apply_layer(layer_idx, layer, aux_states):
        # coupling, attention of the aux rows to the primary K/V, MLP / MoE
        attn = layer.self_attn
        aux_states = aux_states + layer.aux_coupling.weight * entering_states[layer_idx][:, aux_positions]
        normed = layer.input_layernorm(aux_states)
        query = apply_rotary(
            attn._project(normed, plus_adapter(attn.q_proj, attn, "aux_q_adapter"), attn.q_norm),
            cos,
            sin,
        )
        keys, values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
        keys = keys.repeat_interleave(attn.num_key_value_groups, dim=1)
        values = values.repeat_interleave(attn.num_key_value_groups, dim=1)
        key_index = torch.arange(past + num_new - keys.shape[2], past + num_new)  # sliding caches drop old keys
        attended = torch.empty_like(query)
        for b in range(batch):
            for row, seq_index in enumerate(aux_positions.tolist()):
                query_pos = past + seq_index
                allowed = key_index <= query_pos
                if config.sliding_window is not None:
                    allowed &= key_index > query_pos - config.sliding_window
                if attention_mask is not None:
                    allowed &= attention_mask[b, key_index].bool()
                scores = torch.einsum("hd,hsd->hs", query[b, :, row], keys[b]) * attn.scaling
                probs = F.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(values.dtype)
                attended[b, :, row] = torch.einsum("hs,hsd->hd", probs, values[b])
        attended = attended.transpose(1, 2).reshape(batch, len(aux_positions), -1)
        aux_states = aux_states + plus_adapter(attn.o_proj, attn, "aux_o_adapter")(attended)
        normed = layer.post_attention_layernorm(aux_states)
        if isinstance(layer.mlp, DualFlowSparseMoeBlock):
            mlp_out = torch.stack([torch.stack([_moe_row(layer.mlp, x, aux_top_k) for x in row]) for row in normed])
        else:
            mlp_out = layer.mlp(normed)
        if layer.aux_mlp_adapter is not None:
            mlp_out = mlp_out + layer.aux_mlp_adapter(normed)
        return aux_states + mlp_out

    for round_idx in range(num_rounds):
        for layer_idx, layer in enumerate(body.layers):
            layer_output = apply_layer(layer_idx, layer, aux_states)
            if round_idx == 0:
                aux_states = layer_output
            else:  # rounds after the first: the layer's whole update, scaled by its round gate
                aux_states = aux_states + layer.aux_round_gate.weight * (layer_output - aux_states)
    return model.lm_head(body.norm(aux_states))


@torch.no_grad()
def two_pass_forward(
    model, input_ids, cache, attention_mask=None, position_ids=None, aux_positions=None, aux_top_k=None, num_rounds=None
):
    """Primary pass (fills `cache`), then the aux pass. Returns (primary_logits (B,T,V), aux_logits (B,P,V))."""
    num_new = input_ids.shape[1]
    past = cache.get_seq_length()
    if position_ids is None:
        position_ids = torch.arange(past, past + num_new).unsqueeze(0)
    if aux_positions is None:
        aux_positions = torch.arange(num_new)
    primary = model(
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        use_aux_flow=False,
        output_hidden_states=True,
    )
    aux_logits = aux_pass(
        model,
        input_ids,
        primary.hidden_states,
        cache,
        aux_positions,
        position_ids,
        attention_mask,
        aux_top_k,
        num_rounds,
    )
    return primary.logits, aux_logits
