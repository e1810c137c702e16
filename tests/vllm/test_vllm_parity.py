"""vLLM serves a converted, aux-perturbed Dual-Flow checkpoint with transformers' greedy tokens and log-probabilities
(aux flow on, k_a = 4 != k_p = 2), with prefix caching and chunked prefill on."""

import pytest
from vllm_reference import (
    AUX_TOP_K,
    ENGINE_ARGS,
    assert_matches_transformers,
    hf_greedy,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
TOKEN_BUDGET = ENGINE_ARGS["max_num_batched_tokens"]  # longer prompts (and batches) are prefilled in chunks
PROMPTS = random_prompts([3, 17, 40, 29])


@pytest.fixture(scope="module")
def engine(checkpoint):
    with running_engine(checkpoint, enable_prefix_caching=True, enable_chunked_prefill=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def test_checkpoint_aux_flow_differs_from_primary(checkpoint, reference):
    assert reference.config.aux_num_experts_per_tok == AUX_TOP_K != reference.config.num_experts_per_tok
    aux = [hf_greedy(reference, p, MAX_NEW)[0] for p in PROMPTS]
    primary = [hf_greedy(reference, p, MAX_NEW, use_aux_flow=False)[0] for p in PROMPTS]
    assert aux != primary


def test_engine_uses_fast_prefill_for_the_aux_flow(engine):
    config = engine.llm_engine.vllm_config
    assert config.model_config.architecture == "DualFlowForCausalLM"
    assert config.cache_config.kv_sharing_fast_prefill
    assert config.cache_config.enable_prefix_caching and config.scheduler_config.enable_chunked_prefill


def test_greedy_batch_matches_transformers(engine, reference):
    assert_matches_transformers(served_greedy(engine, PROMPTS, MAX_NEW), PROMPTS, reference, MAX_NEW)


def test_chunked_prefill_of_a_long_prompt(engine, reference):
    prompt = random_prompts([3 * TOKEN_BUDGET + 5], seed=1)
    assert_matches_transformers(served_greedy(engine, prompt, MAX_NEW), prompt, reference, MAX_NEW)


def test_prefix_cache_hits_match_transformers(engine, reference):
    prefix = random_prompts([70], seed=2)[0]
    first = [prefix + [7]]
    later = [prefix + [9, 11], prefix + [13, 15, 17]]
    served_greedy(engine, first, MAX_NEW)
    outputs = served_greedy(engine, later, MAX_NEW)
    assert all(output.num_cached_tokens >= 64 for output in outputs)  # two full 32-token blocks of the prefix
    assert_matches_transformers(outputs, later, reference, MAX_NEW)
