"""
The Dual-Flow forward without grouping: the primary flow, then the aux flow as a second batched pass over the layers.

This is the fair baseline for the grouped execution (both flows' rows through each shared weight at once): same weights, same result, every operation
batched over all aux rows (one attention call and one experts call per layer), but each weight is read twice per step,
once per flow. `dualflow compare` times it beside the grouped model.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from modeling_dualflow import DualFlowCache
from modeling_dualflow.attention_dualflow import apply_rotary
from modeling_dualflow.modeling_dualflow import CACHE_FIELD, DualFlowSparseMoeBlock


class TwoPassDualFlow(nn.Module):
    """
    Wraps a `DualFlowForCausalLM`; `forward` returns the aux flow's logits as `logits`. Unpadded batches only (no
    attention mask). The cache must keep every key (`DualFlowCache()` without a config, the default): a sliding-window
    cache drops keys that earlier rows of the same chunk still attend to once pass 1 is over.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.no_grad()
    def forward(
        self, input_ids, cache=None, use_cache=True, logits_to_keep: int = 0, aux_num_experts_per_tok=None
    ) -> CausalLMOutputWithPast:
        if self.model.config.aux_num_rounds != 1:
            raise ValueError("the two-pass execution covers one aux round (aux_num_rounds=1)")
        if self.model.config.aux_adapter_rank:
            raise ValueError("the two-pass execution covers models without aux adapters (aux_adapter_rank=0)")
        cache = cache if cache is not None else DualFlowCache()
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            raise ValueError("the two-pass execution needs a cache that keeps every key: pass DualFlowCache()")
        past, num_new = cache.get_seq_length(), input_ids.shape[1]
        # Pass 1: the primary flow alone; it fills the cache and gives the states entering each layer.
        primary = self.model(input_ids, cache=cache, use_cache=True, use_aux_flow=False, output_hidden_states=True)
        rows = torch.arange(num_new - logits_to_keep if logits_to_keep else 0, num_new, device=input_ids.device)
        entering_states = [states[:, rows] for states in primary.hidden_states[:-1]]
        aux_top_k = aux_num_experts_per_tok or self.model.config.aux_num_experts_per_tok
        logits = self._aux_pass(input_ids[:, rows], entering_states, cache, past + rows, past + num_new, aux_top_k)
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: cache})

    def _aux_pass(self, aux_ids, entering_states, cache, query_positions, total: int, aux_top_k: int):
        # Pass 2: the aux rows (batch, P, hidden) walk every layer again and read the keys/values pass 1 cached.
        # query_positions: (P,) positions in the sequence; total: tokens in the sequence so far.
        body, config = self.model.model, self.model.config
        states = body.aux_embed_tokens(aux_ids)
        cos, sin = body.rotary_emb(states, query_positions.expand(aux_ids.shape[0], -1))
        for layer, entering in zip(body.layers, entering_states):
            attention = layer.self_attn
            states = states + layer.aux_coupling(entering)
            normed = layer.input_layernorm(states)
            queries = apply_rotary(attention._project(normed, attention.q_proj, attention.q_norm), cos, sin)
            keys, values = cache.layers[attention.layer_idx].keys, cache.layers[attention.layer_idx].values
            # A sliding-window cache keeps only the last keys: they are the end of the sequence.
            key_positions = torch.arange(total - keys.shape[2], total, device=keys.device)
            allowed = key_positions[None, :] <= query_positions[:, None]  # (P, keys)
            if config.sliding_window is not None:
                allowed &= key_positions[None, :] > query_positions[:, None] - config.sliding_window
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=allowed, scale=attention.scaling, enable_gqa=True
            )
            states = states + attention.o_proj(attended.transpose(1, 2).reshape(*states.shape[:2], -1))
            normed = layer.post_attention_layernorm(states)
            if isinstance(layer.mlp, DualFlowSparseMoeBlock):
                states = states + layer.mlp(normed, num_primary=0, aux_top_k=aux_top_k)
            else:
                states = states + layer.mlp(normed)
        return self.model.lm_head(body.norm(states))
