"""Tensor parallelism 2 on vLLM's CPU build (two worker processes over gloo, one core each): the heads, the experts and
the aux adapters split across the ranks give transformers' greedy tokens and logprobs, with and without a shared
expert."""

import pytest
from vllm_reference import (
    assert_matches_transformers,
    load_reference,
    random_prompts,
    served_greedy,
)


MAX_NEW = 8
# the longest prompt is prefilled in chunks (the engines' token budget is 48)
PROMPTS = random_prompts([5, 17, 60], seed=7)


def attention_heads(model):
    """In each worker: the query heads of the first layer's attention on this rank."""
    return model.model.layers[0].self_attn.num_heads


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tensor_parallel_2_matches_transformers(family, checkpoint, shared_expert_checkpoint, engines, monkeypatch):
    folder = checkpoint if family == "qwen3_moe" else shared_expert_checkpoint
    reference = load_reference(folder)
    # vLLM's CPU workers bind their threads to NUMA nodes by default, and this machine may have one: a core each
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    engine = engines.get(folder, tensor_parallel_size=2)
    heads = engine.apply_model(attention_heads)
    outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert heads == [reference.config.num_attention_heads // 2] * 2
    assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW)
