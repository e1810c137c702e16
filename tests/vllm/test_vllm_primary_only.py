"""`hf_overrides={"use_aux_flow": False}` serves the primary flow alone: the base model, token for token, and the
only Dual-Flow engine whose prompt logprobs vLLM allows (with the aux flow on, vLLM's fast prefill refuses them). On the
checkpoint with every aux-flow part (two rounds, adapters), none of which the primary flow reads."""

import pytest
import torch
from transformers import Qwen3MoeForCausalLM
from vllm import SamplingParams
from vllm_reference import (
    assert_logprobs_close,
    assert_matches_transformers,
    aux_parameter_names,
    hf_greedy,
    load_reference,
    random_prompts,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([5, 33, 21])


@pytest.fixture(scope="module")
def checkpoint(adapter_checkpoint):
    return adapter_checkpoint


@pytest.fixture(scope="module")
def engine(engines, checkpoint):
    return engines.get(checkpoint, hf_overrides={"use_aux_flow": False})  # test_vllm_aux_adapters.py's too


def test_primary_engine_is_the_base_model(engine, checkpoint):
    assert not engine.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill
    source = Qwen3MoeForCausalLM.from_pretrained(checkpoint.parent / "source", dtype=torch.float32).eval()
    reference = load_reference(checkpoint)
    outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW, use_aux_flow=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(source, p, MAX_NEW)[0] for p in PROMPTS]


def test_primary_engine_builds_no_aux_weights(engine):
    # neither the aux embedding, the couplings, the round gates nor the adapters: the checkpoint's aux weights are
    # skipped, not loaded
    assert engine.apply_model(aux_parameter_names) == [[]]


@torch.no_grad()
def test_prompt_logprobs_are_the_base_models(engine, checkpoint):
    prompt = random_prompts([20], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    output = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    served = [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    logits = load_reference(checkpoint)(torch.tensor([prompt]), use_aux_flow=False).logits[0]
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(len(prompt) - 1), prompt[1:]].tolist()
    assert_logprobs_close(served, expected)
