"""A Qwen2-MoE conversion (a gated shared expert beside the routed experts, weights not renormalised): greedy tokens
and logprobs equal transformers' with the shared expert inside vLLM's FusedMoE (k_a = k_p: one all-reduce for both
under tensor parallelism) and beside it (k_a != k_p: chunk rows)."""

import pytest
from vllm_reference import (
    AUX_TOP_K,
    assert_matches_transformers,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([4, 19, 30], seed=6)


def shared_expert_placement(model):
    """In the engine process: per MoE block, whether its shared expert runs inside FusedMoE."""
    return [layer.mlp.shared_expert_in_experts for layer in model.model.layers if layer.mlp.shared_expert is not None]


@pytest.mark.parametrize(("aux_top_k", "inside"), [(2, True), (AUX_TOP_K, False)])
def test_shared_expert_matches_transformers(shared_expert_checkpoint, aux_top_k, inside):
    reference = load_reference(shared_expert_checkpoint)
    assert reference.config.shared_expert_intermediate_size and reference.config.num_experts_per_tok == 2
    overrides = {"aux_num_experts_per_tok": aux_top_k}
    with running_engine(shared_expert_checkpoint, hf_overrides=overrides) as engine:
        placement = engine.apply_model(shared_expert_placement)[0]
        outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert placement == [inside] * reference.config.num_hidden_layers
    assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW, **overrides)
