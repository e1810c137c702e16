"""The served model under vLLM's compilation (`@support_torch_compile`, Inductor's kernels, as a CPU engine runs by
default) gives the eager engine's tokens and transformers' predictions, through chunked prefill (steps where only some
rows are sampled), decode and an overridden k_a that is not a multiple of k_p (chunk rows with padding slots)."""

import pytest
from vllm_reference import (
    assert_logprobs_close,
    assert_matches_transformers,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([3, 17, 60, 29], seed=3)  # 60 > the 48-token budget: prefilled in two chunks
OVERRIDES = {"aux_num_experts_per_tok": 3}
COMPILED = {"mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"}


@pytest.fixture(scope="module")
def served(checkpoint):
    results = {}
    for name, options in (("compiled", {"compilation_config": COMPILED}), ("eager", {"enforce_eager": True})):
        with running_engine(checkpoint, hf_overrides=OVERRIDES, **options) as llm:
            config = llm.llm_engine.vllm_config.compilation_config
            results[name] = (config.mode.name, config.backend, served_greedy(llm, PROMPTS, MAX_NEW))
    return results


def test_compiled_engine_gives_the_eager_engines_tokens(served):
    assert served["compiled"][:2] == ("DYNAMO_TRACE_ONCE", "inductor") and served["eager"][0] == "NONE"
    compiled, eager = (served[name][2] for name in ("compiled", "eager"))
    for a, b in zip(compiled, eager):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        chosen = a.outputs[0].token_ids
        assert_logprobs_close(
            [step[token].logprob for step, token in zip(a.outputs[0].logprobs, chosen)],
            [step[token].logprob for step, token in zip(b.outputs[0].logprobs, chosen)],
        )


def test_compiled_engine_matches_transformers(served, checkpoint):
    reference = load_reference(checkpoint)
    assert_matches_transformers(served["compiled"][2], PROMPTS, reference, MAX_NEW, **OVERRIDES)
