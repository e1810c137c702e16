"""variants: each way of running the weights computes what its name says."""

import torch
from helpers import hand_nll, tiny_model
from reference import two_pass_forward

from dualflow.instruments.variants import BASELINE, build_variants, with_top_k
from dualflow.scoring import next_token_nll
from modeling_dualflow import DualFlowCache


def routing_sensitive_model(**overrides):
    model = tiny_model(**overrides)
    with torch.no_grad():  # random experts at init barely move the output: make the routing visible in the loss
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(20)
            layer.mlp.experts.down_proj.mul_(20)
    return model


def test_variant_losses_match_their_definitions():
    model = routing_sensitive_model(aux_num_experts_per_tok=4)
    blocks = torch.randint(0, model.config.vocab_size, (3, 10))
    variants = {variant.name: variant for variant in build_variants(model)}
    assert list(variants) == [BASELINE, "dual-flow", "two-pass", "single top-k=4"]
    losses = {name: variant.nll(blocks, batch_size=2) for name, variant in variants.items()}
    assert abs(losses[BASELINE] - hand_nll(model, blocks, use_aux_flow=False)) < 1e-5
    assert abs(losses["dual-flow"] - hand_nll(model, blocks, use_aux_flow=True)) < 1e-5
    oracle = [next_token_nll(two_pass_forward(model, block[None], DualFlowCache())[1], block[None]) for block in blocks]
    assert abs(losses["two-pass"] - torch.stack(oracle).mean().item()) < 1e-5
    assert abs(losses["single top-k=4"] - losses[BASELINE]) > 1e-4  # routing to 4 experts changes the model


def test_round_variants_run_fewer_aux_rounds():
    model = routing_sensitive_model(aux_num_experts_per_tok=4, aux_num_rounds=3)
    with torch.no_grad():
        for layer in model.model.layers:  # open the round gates: extra rounds change the prediction
            layer.aux_round_gate.weight.fill_(0.5)
    blocks = torch.randint(0, model.config.vocab_size, (3, 10))
    variants = {variant.name: variant for variant in build_variants(model)}
    assert list(variants) == [BASELINE, "dual-flow", "dual-flow r1", "dual-flow r2", "single top-k=4"]
    losses = {name: variant.nll(blocks, batch_size=2) for name, variant in variants.items()}
    for rounds in (1, 2, 3):
        name = "dual-flow" if rounds == 3 else f"dual-flow r{rounds}"
        assert abs(losses[name] - hand_nll(model, blocks, use_aux_flow=True, aux_num_rounds=rounds)) < 1e-5
    assert len({round(losses[name], 5) for name in ("dual-flow", "dual-flow r1", "dual-flow r2")}) == 3


def test_no_two_pass_variant_for_aux_adapters():
    # the two-pass execution ignores the adapters: timing or scoring it would describe another model
    model = tiny_model(aux_num_experts_per_tok=4, aux_adapter_rank=2)
    assert [variant.name for variant in build_variants(model)] == [BASELINE, "dual-flow", "single top-k=4"]


def test_with_top_k_shares_the_weights_and_routes_wider():
    model = routing_sensitive_model()
    twin = with_top_k(model, 3)
    assert twin.config.num_experts_per_tok == 3 and model.config.num_experts_per_tok == 2
    shared = {name: parameter.data_ptr() for name, parameter in model.named_parameters()}
    assert {name: parameter.data_ptr() for name, parameter in twin.named_parameters()} == shared  # no copy
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        # The same weights at top-3, computed independently: every expert's output weighted by the top-3 routing.
        expected = model.config.__class__(**{**model.config.to_dict(), "num_experts_per_tok": 3})
        fresh = type(model)(expected).eval()
        fresh.load_state_dict(model.state_dict())
        fresh.set_attn_implementation("sdpa")
        torch.testing.assert_close(
            twin(input_ids, use_aux_flow=False).logits, fresh(input_ids, use_aux_flow=False).logits, rtol=0, atol=1e-6
        )
        assert not torch.allclose(
            twin(input_ids, use_aux_flow=False).logits, model(input_ids, use_aux_flow=False).logits
        )
