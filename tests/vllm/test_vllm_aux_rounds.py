"""`aux_num_rounds` = 2 (issue 13): the aux rows pass through the layers twice, the second time alone, coupled to the
same primary states and reading the same paged K/V; greedy tokens and logprobs equal transformers'. On the two-round
checkpoint that also carries aux adapters, served by test_vllm_aux_adapters.py's engine."""

import pytest
from vllm_reference import (
    PREFIX_CACHING_AND_CHUNKED_PREFILL,
    assert_matches_transformers,
    hf_greedy,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([6, 30, 55], seed=4)  # 55 > the 48-token budget: prefilled in chunks


def test_two_aux_rounds_match_transformers(engines, adapter_checkpoint):
    engine = engines.get(adapter_checkpoint, **PREFIX_CACHING_AND_CHUNKED_PREFILL)
    reference = load_reference(adapter_checkpoint)
    assert reference.config.aux_num_rounds == 2
    outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW)
    one_round = [hf_greedy(reference, p, MAX_NEW, aux_num_rounds=1)[0] for p in PROMPTS]
    assert one_round != [list(output.outputs[0].token_ids) for output in outputs]  # the second round matters


def test_rounds_beyond_the_checkpoints_gates_are_refused(checkpoint):
    with (
        pytest.raises(ValueError, match="aux_num_rounds=2 needs round gates"),
        running_engine(checkpoint, hf_overrides={"aux_num_rounds": 2}),
    ):
        pass
