"""two_pass: the aux flow as a second batched pass gives exactly the grouped execution's logits."""

import pytest
import torch
from helpers import tiny_model

from dualflow.instruments.two_pass import TwoPassDualFlow
from modeling_dualflow import DualFlowCache


CONFIGS = {
    "moe, k_a > k_p": dict(aux_num_experts_per_tok=4),
    "moe, k_a < k_p": dict(aux_num_experts_per_tok=1),
    "dense": dict(num_experts=0),
    "sliding window": dict(sliding_window=5, aux_num_experts_per_tok=3),
    "per-head q/k norm": dict(qk_norm="per_head"),
    "full q/k norm, shared expert": dict(qk_norm="full", shared_expert_intermediate_size=16),
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_two_pass_equals_grouped_forward_and_decoding(overrides):
    model = tiny_model(**overrides)
    two_pass = TwoPassDualFlow(model)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(two_pass(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-5)
        grouped_cache, two_pass_cache = DualFlowCache(config=model.config), DualFlowCache()
        for start, end in ((0, 8), (8, 9), (9, 10), (10, 12)):  # prefill, then steps of one and two tokens
            chunk = input_ids[:, start:end]
            expected = model(chunk, past_key_values=grouped_cache, use_cache=True, logits_to_keep=1).logits
            actual = two_pass(chunk, cache=two_pass_cache, logits_to_keep=1).logits
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    assert two_pass_cache.get_seq_length() == 12


def test_two_pass_refuses_a_cache_that_drops_keys():
    model = tiny_model(sliding_window=4)
    with pytest.raises(ValueError, match="keeps every key"):
        TwoPassDualFlow(model)(torch.randint(0, 97, (1, 6)), cache=DualFlowCache(config=model.config))


def test_two_pass_refuses_more_than_one_aux_round():
    model = tiny_model(aux_num_rounds=2)
    with pytest.raises(ValueError, match="one aux round"):
        TwoPassDualFlow(model)(torch.randint(0, 97, (1, 6)))


def test_two_pass_refuses_aux_adapters():
    # The second pass runs the shared weights alone: it would ignore the adapters and score another model.
    model = tiny_model(aux_adapter_rank=2)
    with pytest.raises(ValueError, match="without aux adapters"):
        TwoPassDualFlow(model)(torch.randint(0, 97, (1, 6)))
