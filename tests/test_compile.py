"""Static-cache decoding: same tokens as the Dual-Flow cache, and a decode step torch.compile captures in one graph."""

import pytest
import torch
import torch._dynamo
from helpers import tiny_model
from transformers import AttentionInterface, CompileConfig, DynamicCache, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from modeling_dualflow import DualFlowForCausalLM


@pytest.mark.parametrize("logits_to_keep", [0, 1])
def test_static_cache_prefill_matches_uncached(logits_to_keep):
    """The static cache's empty slots stay masked for the aux rows too (sdpa skips the primary mask at prefill)."""
    model = tiny_model(aux_num_experts_per_tok=3)
    prompt = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(prompt, logits_to_keep=logits_to_keep)
        cache = StaticCache(config=model.config, max_cache_len=16)
        actual = model(prompt, past_key_values=cache, logits_to_keep=logits_to_keep)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(actual.primary_logits, expected.primary_logits, rtol=0, atol=1e-5)


def test_static_cache_generate_matches_dualflow_cache():
    model = tiny_model(aux_num_experts_per_tok=3)
    input_ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    for use_aux_flow in (True, False):
        options = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, use_aux_flow=use_aux_flow)
        dynamic = model.generate(input_ids, **options)
        static = model.generate(input_ids, cache_implementation="static", **options)
        assert torch.equal(static, dynamic), use_aux_flow


@pytest.mark.parametrize("rounds", [1, 2])
def test_decode_step_compiles_to_one_graph(rounds):
    """
    Both flows, two expert fan-outs and the static cache trace without a graph break (fullgraph=True works); so do
    extra aux rounds, whose per-layer outputs a nested `capture_outputs` keeps out of the recorded ones.
    """
    model = tiny_model(aux_num_experts_per_tok=3, aux_num_rounds=rounds)
    prompt = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    cache = StaticCache(config=model.config, max_cache_len=16)

    def decode_step(token, position_ids):
        return model(token, past_key_values=cache, position_ids=position_ids, logits_to_keep=1).logits

    with torch.no_grad():
        model(prompt, past_key_values=cache)
        explanation = torch._dynamo.explain(decode_step)(prompt[:, -1:], torch.tensor([[7]]))
    assert explanation.graph_break_count == 0, [str(reason.reason) for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_fullgraph_compiled_generate_matches_eager():
    """`_can_compile_fullgraph` holds: generate's compiled decode step (fullgraph=True, no graph break) gives the same
    tokens. The "eager" backend runs dynamo's full-graph capture without a C++ toolchain."""
    assert DualFlowForCausalLM._can_compile_fullgraph
    model = tiny_model(aux_num_experts_per_tok=3)
    input_ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=4, do_sample=False)
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers auto-compiles on accelerators only otherwise
    compiled = model.generate(input_ids, cache_implementation="static", compile_config=compile_config, **options)
    assert hasattr(model, "_compiled_call")  # the decode steps really ran compiled
    assert torch.equal(compiled, model.generate(input_ids, **options))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_batch_equals_separate_sequences(attn):
    """
    Padding-free batches (training, no cache): sequences packed in one row, position_ids restarting at 0, no attention
    mask; transformers' mask functions find the sequences from the position ids.
    """
    model = tiny_model(attn_implementation=attn, aux_num_experts_per_tok=3)
    generator = torch.Generator().manual_seed(5)
    first, second = torch.randint(1, 97, (1, 5), generator=generator), torch.randint(1, 97, (1, 4), generator=generator)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0)
    packed = model(torch.cat([first, second], dim=1), position_ids=position_ids, use_cache=False)
    for field in ("logits", "primary_logits"):
        separate = torch.cat([getattr(model(first), field), getattr(model(second), field)], dim=1)
        torch.testing.assert_close(getattr(packed, field), separate, atol=1e-5, rtol=0)


def test_custom_attention_function_sees_plain_causal_calls():
    """
    A function registered with transformers' AttentionInterface is called (and gives sdpa's results) with plain causal
    attention and no mask beyond T x T rows: aux rows at the primary positions (every position, decode) as 4 more query
    heads over the 2 key/value heads in one call per layer; aux rows at the last k positions in a second call of k rows.
    Serving engines' attention backends assume the model's head count and one query row per key row they cache, so
    `_supports_attention_backend` stays False (engines use dualflow.serving).
    """
    assert not DualFlowForCausalLM._supports_attention_backend
    calls = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        mask_rows = None if attention_mask is None else attention_mask.shape[2]
        calls.append((query.shape[1], query.shape[2], key.shape[2], mask_rows))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dualflow_test_recording_sdpa", recording_sdpa)
    AttentionMaskInterface.register("dualflow_test_recording_sdpa", sdpa_mask)  # else transformers builds no mask
    model = tiny_model(aux_num_experts_per_tok=3)
    input_ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 0] = 0
    expected = [model(input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits for keep in (0, 2)]
    model.set_attn_implementation("dualflow_test_recording_sdpa")
    for keep, logits in zip((0, 2), expected):
        torch.testing.assert_close(model(input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits, logits)
    cache = DynamicCache()
    model(input_ids[:, :5], attention_mask=attention_mask[:, :5], past_key_values=cache, logits_to_keep=1)
    model(input_ids[:, 5:], attention_mask=attention_mask, past_key_values=cache, logits_to_keep=1)
    every_position, last_two = [(8, 6, 6, 6)], [(4, 6, 6, 6), (4, 2, 6, 2)]
    prefill, decode = [(4, 5, 5, 5), (4, 1, 5, 1)], [(8, 1, 6, 1)]
    num_layers = model.config.num_hidden_layers
    assert calls == [call for forward in (every_position, last_two, prefill, decode) for call in forward * num_layers]
