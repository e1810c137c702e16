"""`hf_overrides={"aux_at_every_prompt_position": True}`: the aux flow runs at every prompt position, so vLLM's prompt
logprobs (what loglikelihood evaluation reads) are the aux flow's predictions, transformers' forward logits, with
chunked prefill; generation stays transformers' greedy output."""

import pytest
import torch
from vllm import SamplingParams
from vllm_reference import (
    ENGINE_ARGS,
    LOGPROB_TOLERANCE,
    assert_logprobs_close,
    assert_matches_transformers,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


PROMPTS = random_prompts([5, 2 * ENGINE_ARGS["max_num_batched_tokens"] + 7], seed=3)  # the second in 3 chunks


@pytest.fixture(scope="module")
def engine(checkpoint):
    with running_engine(checkpoint, hf_overrides={"aux_at_every_prompt_position": True}) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def test_prompt_logprobs_are_the_aux_flows(engine, reference):
    assert not engine.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            forward = reference(torch.tensor([prompt]))
        aux = torch.log_softmax(forward.logits[0].double(), -1)
        primary = torch.log_softmax(forward.primary_logits[0].double(), -1)
        served = [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        expected = [aux[i, token].item() for i, token in enumerate(prompt[1:])]
        assert_logprobs_close(served, expected)
        # and not the base model's prediction (what the rows other than the sampled ones would give without the option)
        base = [primary[i, token].item() for i, token in enumerate(prompt[1:])]
        assert max(abs(a - b) for a, b in zip(served, base)) > 10 * LOGPROB_TOLERANCE


def test_generation_is_unchanged(engine, reference):
    assert_matches_transformers(served_greedy(engine, PROMPTS, 6), PROMPTS, reference, 6)
