"""`hf_overrides={"aux_num_experts_per_tok": k}` changes k_a without reconverting; under speculative decoding every
verified position is a sampled row, so the aux flow predicts there too and greedy output stays transformers'. The MoE
block routes by the model file's rule; settings the engine cannot serve are refused before it starts."""

import pytest
from vllm import SamplingParams
from vllm_reference import AUX_TOP_K, hf_greedy, load_reference, running_engine


MAX_NEW = 12
OVERRIDDEN_TOP_K = 3  # not a multiple of k_p = 2: exercises the zero-weight padding slots
# Repetitive prompts, so that n-gram speculation proposes drafts.
PROMPTS = [[7, 8, 9, 10] * 5, [20, 21, 22] * 9 + [20, 21]]


@pytest.fixture(scope="module")
def engine(checkpoint):
    with running_engine(
        checkpoint,
        max_num_batched_tokens=64,
        hf_overrides={"aux_num_experts_per_tok": OVERRIDDEN_TOP_K},
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        disable_log_stats=False,
    ) as llm:
        yield llm


def test_overridden_aux_top_k_with_speculative_decoding(engine, checkpoint):
    assert engine.llm_engine.vllm_config.model_config.hf_config.aux_num_experts_per_tok == OVERRIDDEN_TOP_K
    reference = load_reference(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    served = [list(output.outputs[0].token_ids) for output in outputs]
    expected = [hf_greedy(reference, p, MAX_NEW, aux_num_experts_per_tok=OVERRIDDEN_TOP_K)[0] for p in PROMPTS]
    assert served == expected
    accepted = [m.value for m in engine.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"]
    assert accepted and accepted[0] > 0  # drafts were verified, so several rows per request were sampled
    assert expected != [hf_greedy(reference, p, MAX_NEW, aux_num_experts_per_tok=AUX_TOP_K)[0] for p in PROMPTS]


def test_bad_aux_top_k_is_refused_before_the_engine_starts(checkpoint):
    message = r"aux_num_experts_per_tok must be in \[1, num_experts=8\], got 9"
    with (
        pytest.raises(ValueError, match=message),
        running_engine(checkpoint, hf_overrides={"aux_num_experts_per_tok": 9}),
    ):
        pass


def test_head_size_the_cpu_attention_cannot_run_is_refused_before_the_engine_starts(checkpoint):
    message = r"vLLM's CPU attention cannot run head_dim=16 \(supported: 32, 64"
    with pytest.raises(ValueError, match=message), running_engine(checkpoint, hf_overrides={"head_dim": 16}):
        pass
