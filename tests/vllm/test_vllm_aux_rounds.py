"""`aux_num_rounds` = 2 (issue 13): the aux rows pass through the layers twice, the second time alone, coupled to the
same primary states and reading the same paged K/V; greedy tokens and logprobs equal transformers'."""

import pytest
from vllm_reference import (
    assert_matches_transformers,
    build_checkpoint,
    hf_greedy,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([6, 30, 55], seed=4)  # 55 > the 48-token budget: prefilled in chunks


@pytest.fixture(scope="module")
def rounds_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("vllm-rounds"), aux_rounds=2)


@pytest.fixture(scope="module")
def engine(rounds_checkpoint):
    with running_engine(rounds_checkpoint, enable_prefix_caching=True, enable_chunked_prefill=True) as llm:
        yield llm


def test_two_aux_rounds_match_transformers(engine, rounds_checkpoint):
    reference = load_reference(rounds_checkpoint)
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
