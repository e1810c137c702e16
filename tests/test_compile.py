"""Static-cache decoding: same tokens as the Dual-Flow cache, and a decode step torch.compile captures in one graph."""

import pytest
import torch
import torch._dynamo
from conftest import tiny_model
from transformers import StaticCache


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


def test_decode_step_compiles_to_one_graph():
    """Both flows, two expert fan-outs and the static cache trace without a graph break (fullgraph=True works)."""
    model = tiny_model(aux_num_experts_per_tok=3)
    prompt = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    cache = StaticCache(config=model.config, max_cache_len=16)

    def decode_step(token, position_ids):
        return model(token, past_key_values=cache, position_ids=position_ids, logits_to_keep=1).logits

    with torch.no_grad():
        model(prompt, past_key_values=cache)
        explanation = torch._dynamo.explain(decode_step)(prompt[:, -1:], torch.tensor([[7]]))
    assert explanation.graph_break_count == 0, [str(reason.reason) for reason in explanation.break_reasons]
    assert explanation.graph_count == 1
