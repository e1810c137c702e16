"""vLLM serves a converted, aux-perturbed Dual-Flow checkpoint with transformers' greedy tokens and log-probabilities
(aux flow on, k_a = 4 != k_p = 2), with prefix caching and chunked prefill on."""

import os

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_reference import (
    AUX_TOP_K,
    ENGINE_ARGS,
    PREFIX_CACHING_AND_CHUNKED_PREFILL,
    assert_matches_transformers,
    hf_greedy,
    load_reference,
    random_prompts,
    served_greedy,
)

from dualflow.serving.vllm_internals import runs_model_runner_v2


MAX_NEW = 8
TOKEN_BUDGET = ENGINE_ARGS["max_num_batched_tokens"]  # longer prompts (and batches) are prefilled in chunks
PROMPTS = random_prompts([3, 17, 40, 29])


@pytest.fixture(scope="module")
def engine(engines, checkpoint):
    return engines.get(checkpoint, **PREFIX_CACHING_AND_CHUNKED_PREFILL)


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


def model_runner_module(worker) -> str:
    return type(worker.model_runner).__module__


def test_engine_runs_on_the_model_runner_asked_for(engine):
    # VLLM_USE_V2_MODEL_RUNNER=1 (conftest.py): V2's CPU runner, a subclass of its GPU runner; else V1's CPU runner
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
    assert runs_model_runner_v2(engine.llm_engine.vllm_config) is v2
    expected = "vllm.v1.worker.cpu.model_runner" if v2 else "vllm.v1.worker.cpu_model_runner"
    assert engine.collective_rpc(model_runner_module) == [expected]


def test_offline_prompt_logprobs_are_refused_before_the_engine_and_it_serves_on(engine, reference):
    # vLLM's server refuses them with fast prefill; the offline engine took them and died in its engine core.
    with pytest.raises(
        VLLMValidationError, match=r"has no prompt logprobs: start the engine with hf_overrides="
    ) as refused:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert "\n" not in str(refused.value)
    assert_matches_transformers(served_greedy(engine, PROMPTS[:1], MAX_NEW), PROMPTS[:1], reference, MAX_NEW)


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


def record_attention_calls(model):
    """In the engine process: every real (metadata-carrying) attention kernel call from now on, as (layer, query rows,
    query heads), in `model.attention_calls`. The kernels run unchanged."""
    from vllm.model_executor.layers.attention import Attention

    model.attention_calls = calls = []
    for module in model.modules():
        if isinstance(module, Attention):

            def recorded(layer, query, key, value, kv_cache, metadata, *args, _kernel=module.impl.forward, **kwargs):
                if metadata is not None:
                    calls.append((layer.layer_name, query.shape[0], query.shape[1]))
                return _kernel(layer, query, key, value, kv_cache, metadata, *args, **kwargs)

            module.impl.forward = recorded


def recorded_attention_calls(model):
    return model.attention_calls


def test_decode_reads_the_cache_once_per_layer(engine, reference):
    """A decode step attends for both flows in one call per layer (2H query heads over the primary layer's pages):
    the primary layers' kernels run only in the prefill step, the aux layers' in every step."""
    engine.apply_model(record_attention_calls)
    prompt = random_prompts([11], seed=4)
    assert_matches_transformers(served_greedy(engine, prompt, MAX_NEW), prompt, reference, MAX_NEW)
    calls = engine.apply_model(recorded_attention_calls)[0]
    config = reference.config
    for i in range(config.num_hidden_layers):
        primary = [call[1:] for call in calls if call[0] == f"model.layers.{i}.self_attn.attn"]
        aux = [call[1:] for call in calls if call[0] == f"model.aux_attn.{i}"]
        assert primary == [(11, config.num_attention_heads)]  # the prompt, once
        # the prompt's last row, then one row per decode step, each with both flows' heads
        assert aux == [(1, 2 * config.num_attention_heads)] * MAX_NEW
